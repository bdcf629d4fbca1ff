//! Plugin configuration: the JSON users write (`*Json` serde structs), validated
//! by `TryFrom` into the runtime [`Config`]. Every error names the key at fault.

use serde::Deserialize;
use std::fmt;
use std::net::SocketAddr;

/// Largest data-parallel size accepted, configured or reported (bounds memory).
pub const MAX_DP_SIZE: u32 = 4096;
/// Smallest poll interval: below this the poll itself becomes the load.
pub const MIN_POLL_INTERVAL_MS: u64 = 100;

/// SGLang field names that select the serving rank; all are accepted by the
/// server, so a request must not carry a client value under any of them.
pub const RANK_FIELD_ALIASES: [&str; 2] = ["routed_dp_rank", "data_parallel_rank"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigJson {
    pub workers: Vec<WorkerJson>,
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
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerJson {
    pub address: String,
    #[serde(default)]
    pub dp_size: Option<u32>,
    #[serde(default)]
    pub name: Option<String>,
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
}

impl Worker {
    /// `ip:port` as Envoy prints host addresses (the override_host value).
    pub fn endpoint(&self) -> String {
        self.address.to_string()
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
}

pub const DEFAULT_POLL_CLUSTER: &str = "dprank_poll";
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
        let json: ConfigJson =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
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

fn validate_workers(json: Vec<WorkerJson>) -> Result<Vec<Worker>, ConfigError> {
    if json.is_empty() {
        return Err(invalid("workers", "at least one worker is required"));
    }
    let mut workers: Vec<Worker> = Vec::with_capacity(json.len());
    for (i, w) in json.into_iter().enumerate() {
        let key = format!("workers[{i}]");
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
            None => address
                .to_string()
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect(),
        };
        if workers.iter().any(|o| o.address == address) {
            return Err(invalid(
                format!("{key}.address"),
                format!("{address} is listed twice"),
            ));
        }
        if workers.iter().any(|o| o.name == name) {
            return Err(invalid(
                format!("{key}.name"),
                format!("`{name}` is used twice"),
            ));
        }
        workers.push(Worker {
            name,
            address,
            dp_size: w.dp_size,
        });
    }
    Ok(workers)
}

impl TryFrom<ConfigJson> for Config {
    type Error = ConfigError;

    fn try_from(json: ConfigJson) -> Result<Self, Self::Error> {
        let workers = validate_workers(json.workers)?;

        let poll_interval_ms = json.poll_interval_ms.unwrap_or(DEFAULT_POLL_INTERVAL_MS);
        if poll_interval_ms < MIN_POLL_INTERVAL_MS {
            return Err(invalid(
                "poll_interval_ms",
                format!("must be at least {MIN_POLL_INTERVAL_MS}, got {poll_interval_ms}"),
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
                format!(
                    "must be at least poll_interval_ms ({poll_interval_ms}), got {stale_after_ms}"
                ),
            ));
        }

        let rank_field = match (json.rank_field, json.naming.unwrap_or(Naming::Current)) {
            (Some(name), _) => {
                if name.is_empty() || name.contains('"') || name.contains('\\') {
                    return Err(invalid(
                        "rank_field",
                        format!("`{name}` is not a usable JSON key"),
                    ));
                }
                name
            }
            (None, Naming::Current) => "routed_dp_rank".to_string(),
            (None, Naming::Legacy) => "data_parallel_rank".to_string(),
        };

        let paths = match json.paths {
            Some(paths) => {
                if paths.is_empty() {
                    return Err(invalid("paths", "at least one path is required"));
                }
                if let Some(p) = paths
                    .iter()
                    .find(|p| !p.starts_with('/') || p.contains('?'))
                {
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
        assert_eq!(
            c.rank_field_names(),
            vec!["data_parallel_rank", "routed_dp_rank"]
        );
    }

    #[test]
    fn explicit_rank_field_wins_over_naming() {
        let c = parse(
            r#"{"workers":[{"address":"127.0.0.1:1"}],"naming":"legacy","rank_field":"my_rank"}"#,
        )
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
        let err =
            parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"poll_intervall_ms":5}"#).unwrap_err();
        assert!(err.to_string().contains("poll_intervall_ms"), "{err}");
    }

    #[test]
    fn not_json_is_rejected() {
        assert!(matches!(parse("workers: []"), Err(ConfigError::Json(_))));
    }

    #[test]
    fn wrong_enum_value_is_named() {
        let err = parse(r#"{"workers":[{"address":"127.0.0.1:1"}],"load_endpoint":"metrics"}"#)
            .unwrap_err();
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
        let r = parse(
            r#"{"workers":[{"address":"127.0.0.1:1"},{"address":"127.0.0.1:1","name":"b"}]}"#,
        );
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
            key_of(parse(
                r#"{"workers":[{"address":"127.0.0.1:1","dp_size":0}]}"#
            )),
            "workers[0].dp_size"
        );
        assert_eq!(
            key_of(parse(
                r#"{"workers":[{"address":"127.0.0.1:1","dp_size":5000}]}"#
            )),
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
        let r = parse(
            r#"{"workers":[{"address":"127.0.0.1:1"}],"poll_interval_ms":500,"poll_timeout_ms":600}"#,
        );
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
            key_of(parse(
                r#"{"workers":[{"address":"127.0.0.1:1"}],"paths":[]}"#
            )),
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
}
