//! Plugin configuration: the JSON users write (`*Json` serde structs), validated
//! by `TryFrom` into the runtime [`Config`]. Every error names the key at fault.

use serde::Deserialize;
use std::fmt;
use std::net::SocketAddr;

/// Largest data-parallel size accepted, configured or reported (bounds memory).
pub const MAX_DP_SIZE: u32 = 4096;
/// Smallest poll interval: below this the poll itself becomes the load.
pub const MIN_POLL_INTERVAL_MS: u64 = 100;
/// Largest poll interval (an hour): beyond it load data means nothing.
pub const MAX_POLL_INTERVAL_MS: u64 = 3_600_000;

/// SGLang field names that select the serving rank; all are accepted by the
/// server, so a request must not carry a client value under any of them.
pub const RANK_FIELD_ALIASES: [&str; 2] = ["routed_dp_rank", "data_parallel_rank"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigJson {
    /// Regular mode: the workers requests are routed to.
    #[serde(default)]
    pub workers: Option<Vec<WorkerJson>>,
    /// PD mode: prefill workers (called out to) and decode workers (routed to).
    #[serde(default)]
    pub prefill_workers: Option<Vec<WorkerJson>>,
    #[serde(default)]
    pub decode_workers: Option<Vec<WorkerJson>>,
    #[serde(default)]
    pub prefill_cluster: Option<String>,
    #[serde(default)]
    pub prefill_timeout_ms: Option<u64>,
    #[serde(default)]
    pub prefill_rank_field: Option<String>,
    #[serde(default)]
    pub decode_rank_field: Option<String>,
    #[serde(default)]
    pub decode_prefill_rank_field: Option<String>,
    #[serde(default)]
    pub poll_cluster: Option<String>,
    #[serde(default)]
    pub route_header: Option<String>,
    #[serde(default)]
    pub poll_interval_ms: Option<u64>,
    #[serde(default)]
    pub poll_timeout_ms: Option<u64>,
    #[serde(default)]
    pub stale_after_ms: Option<u64>,
    #[serde(default)]
    pub load_endpoint: Option<LoadEndpoint>,
    #[serde(default)]
    pub naming: Option<Naming>,
    #[serde(default)]
    pub rank_field: Option<String>,
    #[serde(default)]
    pub cost_estimate: Option<CostEstimate>,
    #[serde(default)]
    pub fail_mode: Option<FailMode>,
    #[serde(default)]
    pub paths: Option<Vec<String>>,
    #[serde(default)]
    pub keep_client_rank: Option<bool>,
    #[serde(default)]
    pub pin_header: Option<String>,
    #[serde(default)]
    pub state_key: Option<String>,
    #[serde(default)]
    pub poll_loads: Option<bool>,
    /// Regular mode: follow an Envoy cluster's membership instead of `workers`.
    #[serde(default)]
    pub workers_from_cluster: Option<DiscoveryJson>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryJson {
    pub cluster: String,
    #[serde(default)]
    pub admin_cluster: Option<String>,
}

/// Workers taken from an Envoy cluster, read from the admin API's
/// `/clusters?format=json` through `admin_cluster` (a cluster pointing at
/// Envoy's own admin listener on loopback).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovery {
    pub cluster: String,
    pub admin_cluster: String,
}

pub const DEFAULT_ADMIN_CLUSTER: &str = "dprank_admin";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerJson {
    pub address: String,
    #[serde(default)]
    pub dp_size: Option<u32>,
    #[serde(default)]
    pub name: Option<String>,
    /// Prefill workers only: the KV bootstrap port, told to both sides (null: none).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// Which load endpoint a worker is polled on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadEndpoint {
    /// `/v1/loads?include=core`, falling back to `/get_load` on 404.
    Auto,
    V1Loads,
    GetLoad,
}

/// Field-name vintages of SGLang.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Naming {
    /// `routed_dp_rank` (SGLang since the field was renamed).
    Current,
    /// `data_parallel_rank` (the seed change).
    Legacy,
}

/// How the tokens a request will add to its rank are estimated from the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CostEstimate {
    /// ceil(UTF-8 bytes of the prompt strings / 4) + number of token ids.
    Bytes,
    /// ceil(whitespace words x 1.3) + number of token ids (smg's formula).
    Words,
    /// Every request costs 1 (request counting).
    One,
}

/// What happens when the filter cannot route a request it should route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailMode {
    /// Pass the request through untouched; the cluster's fallback policy picks.
    Open,
    /// Answer 503 (no load data) or 400 (body not a JSON object).
    Closed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    pub name: String,
    pub address: SocketAddr,
    pub dp_size: Option<u32>,
    pub bootstrap_port: Option<u16>,
}

impl Worker {
    /// `ip:port` as Envoy prints host addresses (the override_host value).
    pub fn endpoint(&self) -> String {
        self.address.to_string()
    }
}

/// Where a rank value comes from, for the fields PD mode writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankOf {
    Prefill,
    Decode,
}

/// PD (prefill/decode disaggregation) settings; `Config::workers` are then
/// the decode workers.
#[derive(Debug, Clone, PartialEq)]
pub struct Prefill {
    pub workers: Vec<Worker>,
    pub cluster: String,
    pub timeout_ms: u64,
    /// Rank fields written into the body sent to the prefill worker.
    pub prefill_body_fields: Vec<(String, RankOf)>,
    /// Rank fields written into the body forwarded to the decode worker.
    pub decode_body_fields: Vec<(String, RankOf)>,
}

impl Prefill {
    /// Every rank field name a client could have sent, on either body.
    pub fn field_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = RANK_FIELD_ALIASES.to_vec();
        for (name, _) in self.prefill_body_fields.iter().chain(&self.decode_body_fields) {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
        names
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub workers: Vec<Worker>,
    pub poll_cluster: String,
    pub route_header: String,
    pub poll_interval_ms: u64,
    pub poll_timeout_ms: u64,
    pub stale_after_ms: u64,
    pub load_endpoint: LoadEndpoint,
    pub rank_field: String,
    pub cost_estimate: CostEstimate,
    pub fail_mode: FailMode,
    pub paths: Vec<String>,
    pub keep_client_rank: bool,
    pub pin_header: Option<String>,
    pub state_key: String,
    /// Whether this plugin instance takes part in polling. Off for HTTP filters
    /// when a singleton `WasmService` with the same vm_id and state_key polls.
    pub poll_loads: bool,
    /// Some in PD mode.
    pub prefill: Option<Prefill>,
    /// Some when the workers come from a cluster's membership; `workers` is
    /// then the current membership (empty until the first discovery).
    pub discovery: Option<Discovery>,
}

pub const DEFAULT_POLL_CLUSTER: &str = "dprank_poll";
pub const DEFAULT_PREFILL_CLUSTER: &str = "dprank_prefill";
pub const DEFAULT_PREFILL_TIMEOUT_MS: u64 = 600_000;
pub const DEFAULT_ROUTE_HEADER: &str = "x-dprank-endpoint";
pub const DEFAULT_POLL_INTERVAL_MS: u64 = 1000;
pub const DEFAULT_PATHS: [&str; 3] = ["/generate", "/v1/completions", "/v1/chat/completions"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigError {
    Json(String),
    Invalid { key: String, reason: String },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Json(e) => write!(f, "configuration is not valid: {e}"),
            ConfigError::Invalid { key, reason } => {
                write!(f, "configuration key `{key}`: {reason}")
            }
        }
    }
}

fn invalid(key: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

impl Config {
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let json: ConfigJson = serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
        Config::try_from(json)
    }

    /// Every rank field name a client could use to pick a rank itself.
    pub fn rank_field_names(&self) -> Vec<&str> {
        let mut names = vec![self.rank_field.as_str()];
        for alias in RANK_FIELD_ALIASES {
            if alias != self.rank_field {
                names.push(alias);
            }
        }
        names
    }

    /// This configuration with another routed pool (a cluster's membership changed).
    pub fn with_workers(&self, workers: Vec<Worker>) -> Config {
        Config {
            workers,
            ..self.clone()
        }
    }

    /// A worker by its index in `all_workers`.
    pub fn worker(&self, index: usize) -> Option<&Worker> {
        self.all_workers().nth(index)
    }

    /// Every polled worker: the routed pool, then the prefill pool in PD mode.
    pub fn all_workers(&self) -> impl Iterator<Item = &Worker> {
        self.workers
            .iter()
            .chain(self.prefill.iter().flat_map(|p| p.workers.iter()))
    }

    pub fn routes_path(&self, path: &str) -> bool {
        let path = path.split('?').next().unwrap_or(path);
        self.paths.iter().any(|p| p == path)
    }
}

fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn is_metric_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Validates one pool. `others` are the workers of pools already validated:
/// addresses and names must be unique across pools (they key shared state and stats).
/// A worker's stat name when the config gives none: its address, '_' for punctuation.
pub fn default_worker_name(address: &SocketAddr) -> String {
    address
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

fn validate_workers(
    list_key: &str,
    json: Vec<WorkerJson>,
    others: &[Worker],
    bootstrap_allowed: bool,
) -> Result<Vec<Worker>, ConfigError> {
    if json.is_empty() {
        return Err(invalid(list_key, "at least one worker is required"));
    }
    let mut workers: Vec<Worker> = Vec::with_capacity(json.len());
    for (i, w) in json.into_iter().enumerate() {
        let key = format!("{list_key}[{i}]");
        if w.bootstrap_port.is_some() && !bootstrap_allowed {
            return Err(invalid(
                format!("{key}.bootstrap_port"),
                "only prefill workers have a bootstrap port",
            ));
        }
        let address: SocketAddr = w.address.parse().map_err(|_| {
            invalid(
                format!("{key}.address"),
                format!(
                    "`{}` is not ip:port (Envoy's override_host matches host addresses, so give the address Envoy sees)",
                    w.address
                ),
            )
        })?;
        if let Some(dp) = w.dp_size {
            if dp == 0 || dp > MAX_DP_SIZE {
                return Err(invalid(
                    format!("{key}.dp_size"),
                    format!("must be 1..={MAX_DP_SIZE}, got {dp}"),
                ));
            }
        }
        let name = match w.name {
            Some(n) if is_metric_name(&n) => n,
            Some(n) => {
                return Err(invalid(
                    format!("{key}.name"),
                    format!("`{n}` may only hold letters, digits, '-' and '_' (it names stats)"),
                ))
            }
            None => default_worker_name(&address),
        };
        if workers.iter().chain(others).any(|o| o.address == address) {
            return Err(invalid(
                format!("{key}.address"),
                format!("{address} is listed twice"),
            ));
        }
        if workers.iter().chain(others).any(|o| o.name == name) {
            return Err(invalid(format!("{key}.name"), format!("`{name}` is used twice")));
        }
        workers.push(Worker {
            name,
            address,
            dp_size: w.dp_size,
            bootstrap_port: w.bootstrap_port,
        });
    }
    Ok(workers)
}

/// A field name dprank writes into bodies verbatim: it must need no JSON escaping.
fn field_name(key: &str, name: Option<String>, default: &str) -> Result<String, ConfigError> {
    match name {
        Some(n) if n.is_empty() || n.chars().any(|c| c == '"' || c == '\\' || c.is_control()) => Err(invalid(
            key,
            format!("{n:?} is not usable as a JSON key written verbatim (no quotes, backslashes or control characters)"),
        )),
        Some(n) => Ok(n),
        None => Ok(default.to_string()),
    }
}

type PdFields = (Vec<(String, RankOf)>, Vec<(String, RankOf)>);

/// The rank fields of each PD body. `current`: prefill body `routed_dp_rank`=p;
/// decode body `routed_dp_rank`=d and `disagg_prefill_dp_rank`=p. `legacy` (the
/// seed change, one body sent to both): `data_parallel_rank`=p, `decode_dp_rank`=d.
fn pd_fields(
    naming: Naming,
    prefill_rank: Option<String>,
    decode_rank: Option<String>,
    decode_prefill_rank: Option<String>,
) -> Result<PdFields, ConfigError> {
    let (p_default, d_default, dp_default) = match naming {
        Naming::Current => ("routed_dp_rank", "routed_dp_rank", "disagg_prefill_dp_rank"),
        Naming::Legacy => ("data_parallel_rank", "decode_dp_rank", "data_parallel_rank"),
    };
    let p = field_name("prefill_rank_field", prefill_rank, p_default)?;
    let d = field_name("decode_rank_field", decode_rank, d_default)?;
    let dp = field_name("decode_prefill_rank_field", decode_prefill_rank, dp_default)?;
    if d == dp {
        return Err(invalid(
            "decode_prefill_rank_field",
            "must differ from decode_rank_field",
        ));
    }
    let decode_fields = vec![(d.clone(), RankOf::Decode), (dp, RankOf::Prefill)];
    let prefill_fields = match naming {
        Naming::Legacy if p != d => vec![(p, RankOf::Prefill), (d, RankOf::Decode)],
        _ => vec![(p, RankOf::Prefill)],
    };
    Ok((prefill_fields, decode_fields))
}

impl TryFrom<ConfigJson> for Config {
    type Error = ConfigError;

    fn try_from(json: ConfigJson) -> Result<Self, Self::Error> {
        let naming = json.naming.unwrap_or(Naming::Current);
        let discovery = match json.workers_from_cluster {
            None => None,
            Some(_)
                if json.workers.is_some()
                    || json.prefill_workers.is_some()
                    || json.decode_workers.is_some() =>
            {
                return Err(invalid(
                    "workers_from_cluster",
                    "replaces `workers` (regular mode only): list workers or name a cluster, not both",
                ))
            }
            Some(d) => {
                let admin_cluster = d
                    .admin_cluster
                    .unwrap_or_else(|| DEFAULT_ADMIN_CLUSTER.to_string());
                if d.cluster.is_empty() || admin_cluster.is_empty() {
                    return Err(invalid(
                        "workers_from_cluster",
                        "`cluster` and `admin_cluster` must not be empty",
                    ));
                }
                Some(Discovery {
                    cluster: d.cluster,
                    admin_cluster,
                })
            }
        };
        let listed = if discovery.is_some() {
            Some(Vec::new())
        } else {
            json.workers
        };
        let (workers, prefill) = match (listed, json.prefill_workers, json.decode_workers) {
            (Some(workers), None, None) => {
                let pd_only = [
                    ("prefill_cluster", json.prefill_cluster.is_some()),
                    ("prefill_timeout_ms", json.prefill_timeout_ms.is_some()),
                    ("prefill_rank_field", json.prefill_rank_field.is_some()),
                    ("decode_rank_field", json.decode_rank_field.is_some()),
                    (
                        "decode_prefill_rank_field",
                        json.decode_prefill_rank_field.is_some(),
                    ),
                ];
                if let Some((key, _)) = pd_only.iter().find(|(_, set)| *set) {
                    return Err(invalid(
                        *key,
                        "applies to PD mode only (prefill_workers and decode_workers)",
                    ));
                }
                if discovery.is_some() {
                    (Vec::new(), None)
                } else {
                    (validate_workers("workers", workers, &[], false)?, None)
                }
            }
            (None, Some(prefill), Some(decode)) => {
                let decode = validate_workers("decode_workers", decode, &[], false)?;
                let prefill_workers = validate_workers("prefill_workers", prefill, &decode, true)?;
                let cluster = json
                    .prefill_cluster
                    .unwrap_or_else(|| DEFAULT_PREFILL_CLUSTER.to_string());
                if cluster.is_empty() {
                    return Err(invalid("prefill_cluster", "must not be empty"));
                }
                let timeout_ms = json.prefill_timeout_ms.unwrap_or(DEFAULT_PREFILL_TIMEOUT_MS);
                if timeout_ms == 0 {
                    return Err(invalid("prefill_timeout_ms", "must be positive"));
                }
                if json.rank_field.is_some() {
                    return Err(invalid(
                        "rank_field",
                        "PD mode names its fields with prefill_rank_field, decode_rank_field and decode_prefill_rank_field",
                    ));
                }
                let (prefill_body_fields, decode_body_fields) = pd_fields(
                    naming,
                    json.prefill_rank_field,
                    json.decode_rank_field,
                    json.decode_prefill_rank_field,
                )?;
                (
                    decode,
                    Some(Prefill {
                        workers: prefill_workers,
                        cluster,
                        timeout_ms,
                        prefill_body_fields,
                        decode_body_fields,
                    }),
                )
            }
            (None, None, None) => {
                return Err(invalid(
                    "workers",
                    "list `workers`, or `prefill_workers` and `decode_workers` for PD mode",
                ))
            }
            (Some(_), _, _) => {
                return Err(invalid(
                    "workers",
                    "use either `workers` or `prefill_workers` + `decode_workers`, not both",
                ))
            }
            (None, Some(_), None) => {
                return Err(invalid("decode_workers", "PD mode needs decode workers too"))
            }
            (None, None, Some(_)) => {
                return Err(invalid("prefill_workers", "PD mode needs prefill workers too"))
            }
        };

        let poll_interval_ms = json.poll_interval_ms.unwrap_or(DEFAULT_POLL_INTERVAL_MS);
        if !(MIN_POLL_INTERVAL_MS..=MAX_POLL_INTERVAL_MS).contains(&poll_interval_ms) {
            return Err(invalid(
                "poll_interval_ms",
                format!("must be {MIN_POLL_INTERVAL_MS}..={MAX_POLL_INTERVAL_MS}, got {poll_interval_ms}"),
            ));
        }
        let poll_timeout_ms = json.poll_timeout_ms.unwrap_or(poll_interval_ms.min(1000));
        if poll_timeout_ms == 0 || poll_timeout_ms > poll_interval_ms {
            return Err(invalid(
                "poll_timeout_ms",
                format!("must be 1..=poll_interval_ms ({poll_interval_ms}), got {poll_timeout_ms}"),
            ));
        }
        let stale_after_ms = json.stale_after_ms.unwrap_or(3 * poll_interval_ms);
        if stale_after_ms < poll_interval_ms {
            return Err(invalid(
                "stale_after_ms",
                format!("must be at least poll_interval_ms ({poll_interval_ms}), got {stale_after_ms}"),
            ));
        }

        let rank_field = field_name(
            "rank_field",
            json.rank_field,
            match naming {
                Naming::Current => "routed_dp_rank",
                Naming::Legacy => "data_parallel_rank",
            },
        )?;

        let paths = match json.paths {
            Some(paths) => {
                if paths.is_empty() {
                    return Err(invalid("paths", "at least one path is required"));
                }
                if let Some(p) = paths.iter().find(|p| !p.starts_with('/') || p.contains('?')) {
                    return Err(invalid(
                        "paths",
                        format!("`{p}` must start with '/' and hold no query"),
                    ));
                }
                paths
            }
            None => DEFAULT_PATHS.iter().map(|p| p.to_string()).collect(),
        };

        let route_header = json
            .route_header
            .unwrap_or_else(|| DEFAULT_ROUTE_HEADER.to_string());
        if !is_header_name(&route_header) {
            return Err(invalid(
                "route_header",
                format!("`{route_header}` is not a lowercase header name"),
            ));
        }
        let pin_header = match json.pin_header {
            Some(h) if !is_header_name(&h) => {
                return Err(invalid(
                    "pin_header",
                    format!("`{h}` is not a lowercase header name"),
                ))
            }
            Some(h) if h == route_header => {
                return Err(invalid("pin_header", "must differ from route_header"))
            }
            other => other,
        };

        let poll_cluster = json
            .poll_cluster
            .unwrap_or_else(|| DEFAULT_POLL_CLUSTER.to_string());
        if poll_cluster.is_empty() {
            return Err(invalid("poll_cluster", "must not be empty"));
        }
        let state_key = json.state_key.unwrap_or_else(|| "dprank".to_string());
        if !is_metric_name(&state_key) {
            return Err(invalid(
                "state_key",
                format!("`{state_key}` may only hold letters, digits, '-' and '_'"),
            ));
        }

        Ok(Config {
            workers,
            poll_cluster,
            route_header,
            poll_interval_ms,
            poll_timeout_ms,
            stale_after_ms,
            load_endpoint: json.load_endpoint.unwrap_or(LoadEndpoint::Auto),
            rank_field,
            cost_estimate: json.cost_estimate.unwrap_or(CostEstimate::Bytes),
            fail_mode: json.fail_mode.unwrap_or(FailMode::Open),
            paths,
            keep_client_rank: json.keep_client_rank.unwrap_or(false),
            pin_header,
            state_key,
            poll_loads: json.poll_loads.unwrap_or(true),
            prefill,
            discovery,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::from_json(s.as_bytes())
    }

    fn key_of(r: Result<Config, ConfigError>) -> String {
        match r {
            Err(ConfigError::Invalid { key, .. }) => key,
            other => panic!("expected an invalid key, got {other:?}"),
        }
    }

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = parse(r#"{"workers":[{"address":"127.0.0.1:30001"}]}"#).unwrap();
        assert_eq!(c.workers[0].name, "127_0_0_1_30001");
        assert_eq!(c.workers[0].endpoint(), "127.0.0.1:30001");
        assert_eq!(c.poll_cluster, "dprank_poll");
        assert_eq!(c.route_header, "x-dprank-endpoint");
        assert_eq!(c.poll_interval_ms, 1000);
        assert_eq!(c.poll_timeout_ms, 1000);
        assert_eq!(c.stale_after_ms, 3000);
        assert_eq!(c.load_endpoint, LoadEndpoint::Auto);
        assert_eq!(c.rank_field, "routed_dp_rank");
        assert_eq!(c.cost_estimate, CostEstimate::Bytes);
        assert_eq!(c.fail_mode, FailMode::Open);
        assert_eq!(c.paths, DEFAULT_PATHS);
        assert!(!c.keep_client_rank);
        assert_eq!(c.pin_header, None);
        assert!(c.poll_loads);
    }

    #[test]
    fn full_config_is_taken_as_written() {
        let c = parse(
            r#"{"workers":[{"address":"10.0.0.1:8000","dp_size":8,"name":"a"},{"address":"[::1]:8000"}],
                "poll_cluster":"polls","route_header":"x-pick","poll_interval_ms":250,"poll_timeout_ms":200,
                "stale_after_ms":1000,"load_endpoint":"get_load","naming":"legacy","cost_estimate":"words",
                "fail_mode":"closed","paths":["/generate"],"keep_client_rank":true,"pin_header":"x-pin",
                "state_key":"fleet_a","poll_loads":false}"#,
        )
        .unwrap();
        assert_eq!(c.workers[0].dp_size, Some(8));
        assert_eq!(c.workers[1].endpoint(), "[::1]:8000");
        assert_eq!(c.rank_field, "data_parallel_rank");
        assert_eq!(c.poll_timeout_ms, 200);
        assert_eq!(c.fail_mode, FailMode::Closed);
        assert_eq!(c.pin_header.as_deref(), Some("x-pin"));
        assert!(!c.poll_loads);
        assert_eq!(c.rank_field_names(), vec!["data_parallel_rank", "routed_dp_rank"]);
    }

    #[test]
    fn explicit_rank_field_wins_over_naming() {
        let c = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"naming":"legacy","rank_field":"my_rank"}"#)
            .unwrap();
        assert_eq!(
            c.rank_field_names(),
            vec!["my_rank", "routed_dp_rank", "data_parallel_rank"]
        );
    }

    #[test]
    fn routes_path_ignores_query() {
        let c = parse(r#"{"workers":[{"address":"127.0.0.1:1"}]}"#).unwrap();
        assert!(c.routes_path("/generate?x=1"));
        assert!(!c.routes_path("/generate/x"));
    }

    #[test]
    fn unknown_key_is_named() {
        let err = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"poll_intervall_ms":5}"#).unwrap_err();
        assert!(err.to_string().contains("poll_intervall_ms"), "{err}");
    }

    #[test]
    fn not_json_is_rejected() {
        assert!(matches!(parse("workers: []"), Err(ConfigError::Json(_))));
    }

    #[test]
    fn wrong_enum_value_is_named() {
        let err = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"load_endpoint":"metrics"}"#).unwrap_err();
        assert!(err.to_string().contains("metrics"), "{err}");
    }

    #[test]
    fn no_workers_rejected() {
        assert_eq!(key_of(parse(r#"{"workers":[]}"#)), "workers");
    }

    #[test]
    fn hostname_address_rejected() {
        assert_eq!(
            key_of(parse(r#"{"workers":[{"address":"sglang:30000"}]}"#)),
            "workers[0].address"
        );
    }

    #[test]
    fn duplicate_address_rejected() {
        let r = parse(r#"{"workers":[{"address":"127.0.0.1:1"},{"address":"127.0.0.1:1","name":"b"}]}"#);
        assert_eq!(key_of(r), "workers[1].address");
    }

    #[test]
    fn duplicate_name_rejected() {
        let r = parse(
            r#"{"workers":[{"address":"127.0.0.1:1","name":"a"},{"address":"127.0.0.1:2","name":"a"}]}"#,
        );
        assert_eq!(key_of(r), "workers[1].name");
    }

    #[test]
    fn bad_worker_name_rejected() {
        let r = parse(r#"{"workers":[{"address":"127.0.0.1:1","name":"a.b"}]}"#);
        assert_eq!(key_of(r), "workers[0].name");
    }

    #[test]
    fn zero_and_huge_dp_size_rejected() {
        assert_eq!(
            key_of(parse(r#"{"workers":[{"address":"127.0.0.1:1","dp_size":0}]}"#)),
            "workers[0].dp_size"
        );
        assert_eq!(
            key_of(parse(r#"{"workers":[{"address":"127.0.0.1:1","dp_size":5000}]}"#)),
            "workers[0].dp_size"
        );
    }

    #[test]
    fn too_short_interval_rejected() {
        let r = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"poll_interval_ms":10}"#);
        assert_eq!(key_of(r), "poll_interval_ms");
    }

    #[test]
    fn timeout_longer_than_interval_rejected() {
        let r =
            parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"poll_interval_ms":500,"poll_timeout_ms":600}"#);
        assert_eq!(key_of(r), "poll_timeout_ms");
    }

    #[test]
    fn stale_limit_below_interval_rejected() {
        let r = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"stale_after_ms":500}"#);
        assert_eq!(key_of(r), "stale_after_ms");
    }

    #[test]
    fn bad_rank_field_rejected() {
        assert_eq!(
            key_of(parse(
                r#"{"workers":[{"address":"127.0.0.1:1"}],"rank_field":""}"#
            )),
            "rank_field"
        );
    }

    #[test]
    fn bad_paths_rejected() {
        assert_eq!(
            key_of(parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"paths":[]}"#)),
            "paths"
        );
        assert_eq!(
            key_of(parse(
                r#"{"workers":[{"address":"127.0.0.1:1"}],"paths":["generate"]}"#
            )),
            "paths"
        );
    }

    #[test]
    fn bad_headers_rejected() {
        assert_eq!(
            key_of(parse(
                r#"{"workers":[{"address":"127.0.0.1:1"}],"route_header":"X-Pick"}"#
            )),
            "route_header"
        );
        assert_eq!(
            key_of(parse(
                r#"{"workers":[{"address":"127.0.0.1:1"}],"pin_header":"x-dprank-endpoint"}"#
            )),
            "pin_header"
        );
    }

    #[test]
    fn empty_poll_cluster_rejected() {
        assert_eq!(
            key_of(parse(
                r#"{"workers":[{"address":"127.0.0.1:1"}],"poll_cluster":""}"#
            )),
            "poll_cluster"
        );
    }

    #[test]
    fn bad_state_key_rejected() {
        assert_eq!(
            key_of(parse(
                r#"{"workers":[{"address":"127.0.0.1:1"}],"state_key":"a.b"}"#
            )),
            "state_key"
        );
    }
    const PD: &str = r#""prefill_workers":[{"address":"127.0.0.1:1","name":"p0","bootstrap_port":8998},{"address":"127.0.0.1:2","name":"p1"}],"decode_workers":[{"address":"127.0.0.1:3","name":"d0"}]"#;

    fn pd(extra: &str) -> Result<Config, ConfigError> {
        parse(&format!("{{{PD}{extra}}}"))
    }

    #[test]
    fn pd_mode_current_naming() {
        let c = pd("").unwrap();
        let p = c.prefill.as_ref().unwrap();
        assert_eq!(c.workers[0].name, "d0");
        assert_eq!(p.workers[0].bootstrap_port, Some(8998));
        assert_eq!(p.workers[1].bootstrap_port, None);
        assert_eq!(p.cluster, "dprank_prefill");
        assert_eq!(p.timeout_ms, 600_000);
        assert_eq!(
            p.prefill_body_fields,
            vec![("routed_dp_rank".to_string(), RankOf::Prefill)]
        );
        assert_eq!(
            p.decode_body_fields,
            vec![
                ("routed_dp_rank".to_string(), RankOf::Decode),
                ("disagg_prefill_dp_rank".to_string(), RankOf::Prefill)
            ]
        );
        let names: Vec<&str> = c.all_workers().map(|w| w.name.as_str()).collect();
        assert_eq!(names, vec!["d0", "p0", "p1"]);
    }

    #[test]
    fn pd_mode_legacy_naming_sends_both_ranks_on_both_bodies() {
        let c = pd(r#","naming":"legacy""#).unwrap();
        let p = c.prefill.unwrap();
        let both = vec![
            ("data_parallel_rank".to_string(), RankOf::Prefill),
            ("decode_dp_rank".to_string(), RankOf::Decode),
        ];
        assert_eq!(p.prefill_body_fields, both);
        assert_eq!(p.decode_body_fields, vec![both[1].clone(), both[0].clone()]);
    }

    #[test]
    fn pd_mode_explicit_field_names() {
        let c = pd(r#","prefill_rank_field":"pr","decode_rank_field":"dr","decode_prefill_rank_field":"dpr","prefill_cluster":"pc","prefill_timeout_ms":5000"#)
            .unwrap();
        let p = c.prefill.unwrap();
        assert_eq!(p.prefill_body_fields, vec![("pr".to_string(), RankOf::Prefill)]);
        assert_eq!(p.decode_body_fields[1], ("dpr".to_string(), RankOf::Prefill));
        assert_eq!((p.cluster.as_str(), p.timeout_ms), ("pc", 5000));
        assert!(p.field_names().contains(&"dr"));
    }

    #[test]
    fn pd_mode_errors_name_their_key() {
        assert_eq!(key_of(pd(r#","workers":[{"address":"127.0.0.1:9"}]"#)), "workers");
        assert_eq!(
            key_of(parse(r#"{"prefill_workers":[{"address":"127.0.0.1:1"}]}"#)),
            "decode_workers"
        );
        assert_eq!(
            key_of(parse(r#"{"decode_workers":[{"address":"127.0.0.1:1"}]}"#)),
            "prefill_workers"
        );
        assert_eq!(key_of(parse("{}")), "workers");
        assert_eq!(
            key_of(parse(
                r#"{"prefill_workers":[{"address":"127.0.0.1:3"}],"decode_workers":[{"address":"127.0.0.1:3"}]}"#
            )),
            "prefill_workers[0].address"
        );
        assert_eq!(
            key_of(parse(
                r#"{"prefill_workers":[{"address":"127.0.0.1:1"}],"decode_workers":[{"address":"127.0.0.1:3","bootstrap_port":1}]}"#
            )),
            "decode_workers[0].bootstrap_port"
        );
        assert_eq!(key_of(pd(r#","rank_field":"x""#)), "rank_field");
        assert_eq!(key_of(pd(r#","prefill_timeout_ms":0"#)), "prefill_timeout_ms");
        assert_eq!(
            key_of(pd(r#","decode_rank_field":"x","decode_prefill_rank_field":"x""#)),
            "decode_prefill_rank_field"
        );
    }

    #[test]
    fn pd_keys_rejected_in_regular_mode() {
        assert_eq!(
            key_of(parse(
                r#"{"workers":[{"address":"127.0.0.1:1"}],"prefill_cluster":"x"}"#
            )),
            "prefill_cluster"
        );
        assert_eq!(
            key_of(parse(
                r#"{"workers":[{"address":"127.0.0.1:1","bootstrap_port":8998}]}"#
            )),
            "workers[0].bootstrap_port"
        );
    }

    #[test]
    fn workers_from_cluster() {
        let c = parse(r#"{"workers_from_cluster":{"cluster":"sglang"}}"#).unwrap();
        assert!(c.workers.is_empty());
        assert_eq!(
            c.discovery,
            Some(Discovery {
                cluster: "sglang".into(),
                admin_cluster: "dprank_admin".into()
            })
        );
        let c = parse(r#"{"workers_from_cluster":{"cluster":"s","admin_cluster":"a"}}"#).unwrap();
        assert_eq!(c.discovery.unwrap().admin_cluster, "a");
    }

    #[test]
    fn workers_from_cluster_errors() {
        assert_eq!(
            key_of(parse(
                r#"{"workers_from_cluster":{"cluster":"s"},"workers":[{"address":"127.0.0.1:1"}]}"#
            )),
            "workers_from_cluster"
        );
        assert_eq!(
            key_of(parse(&format!(
                r#"{{{PD},"workers_from_cluster":{{"cluster":"s"}}}}"#
            ))),
            "workers_from_cluster"
        );
        assert_eq!(
            key_of(parse(r#"{"workers_from_cluster":{"cluster":""}}"#)),
            "workers_from_cluster"
        );
        assert!(parse(r#"{"workers_from_cluster":{"name":"s"}}"#).is_err());
    }

    #[test]
    fn huge_poll_interval_rejected_not_overflowed() {
        let r = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"poll_interval_ms":6148914691236517206}"#);
        assert_eq!(key_of(r), "poll_interval_ms");
        let c = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"poll_interval_ms":3600000}"#).unwrap();
        assert_eq!(c.stale_after_ms, 3 * 3_600_000);
    }

    #[test]
    fn field_names_needing_escapes_rejected() {
        // As they appear inside the JSON string: a control character, a quote, a backslash, nothing.
        for name in [r"rank\u0001", r#"a\"b"#, r"a\\b", ""] {
            let r = parse(&format!(
                r#"{{"workers":[{{"address":"127.0.0.1:1"}}],"rank_field":"{name}"}}"#
            ));
            assert_eq!(key_of(r), "rank_field", "{name}");
        }
        assert_eq!(
            key_of(pd(r#","decode_rank_field":"x\u001f""#)),
            "decode_rank_field"
        );
    }

    #[test]
    fn pd_keys_rejected_with_workers_from_cluster() {
        let r = parse(r#"{"workers_from_cluster":{"cluster":"sglang"},"prefill_rank_field":"x"}"#);
        assert_eq!(key_of(r), "prefill_rank_field");
    }
}
