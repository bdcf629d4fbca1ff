//! Plugin configuration: the JSON users write (`json.rs`), validated in small
//! named steps (`validate.rs`) into the runtime [`Config`]. Every error names
//! the key at fault.

pub mod admission;
mod checks;
pub mod engine;
pub mod gateways;
mod json;
pub mod prefix;
mod transport;
mod validate;
mod workers;

pub use admission::{Admission, SloTargets, WhenSaturated};
pub use engine::{Engine, EngineKind};
pub use gateways::{Pick, PickRule};
pub use json::{ConfigJson, DiscoveryJson, PassiveHealthJson, WorkerJson};
pub use prefix::{LoadMeasure, Prefix, QueueMeasure};
pub use transport::{
    HeaderTransport, RankTransport, Transport, DEFAULT_COST_WITHOUT_LENGTH, DEFAULT_RANK_HEADERS,
};
pub use workers::default_worker_name;

use serde::{Deserialize, Serialize};
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

pub const DEFAULT_POLL_CLUSTER: &str = "dprank_poll";
pub const DEFAULT_PREFILL_CLUSTER: &str = "dprank_prefill";
pub const DEFAULT_ADMIN_CLUSTER: &str = "dprank_admin";
pub const DEFAULT_PREFILL_TIMEOUT_MS: u64 = 600_000;
pub const DEFAULT_ROUTE_HEADER: &str = "x-dprank-endpoint";
pub const DEFAULT_POLL_INTERVAL_MS: u64 = 1000;
pub const DEFAULT_STATE_KEY: &str = "dprank";
pub const DEFAULT_PATHS: [&str; 3] = ["/generate", "/v1/completions", "/v1/chat/completions"];
/// Passive health defaults: Envoy's outlier detection ejects after 5
/// consecutive 5xx (smg's circuit breaker after 10); the cooldown starts
/// shorter than Envoy's 30 s because a probe costs a single request, and is
/// capped at Envoy's 300 s.
pub const DEFAULT_CONSECUTIVE_FAILURES: u32 = 5;
pub const DEFAULT_COOLDOWN_MS: u64 = 10_000;
pub const DEFAULT_MAX_COOLDOWN_MS: u64 = 300_000;
pub const DEFAULT_PROBE_SHARE: f64 = 0.05;
/// Alternates named after the chosen worker: the shipped route's `num_retries`.
pub const DEFAULT_RETRY_ALTERNATES: u32 = 2;
/// Most alternates a route header may list.
pub const MAX_RETRY_ALTERNATES: u32 = 16;

/// Which load endpoint a worker is polled on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadEndpoint {
    /// `/v1/loads?include=core`, falling back to `/get_load` on 404.
    Auto,
    V1Loads,
    GetLoad,
}

/// Field-name vintages of SGLang (docs/protocol.md, "Rank fields").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Naming {
    /// `routed_dp_rank` (SGLang since the field was renamed).
    Current,
    /// `data_parallel_rank` (the seed change).
    Legacy,
}

/// How the tokens a request will add to its rank are estimated from the body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CostEstimate {
    /// ceil(UTF-8 bytes of the prompt strings / 4) + number of token ids.
    Bytes,
    /// ceil(whitespace words x 1.3) + number of token ids (smg's formula).
    Words,
    /// Every request costs 1 (request counting).
    One,
}

/// How a VM learns the workers' states at each request (`state_reads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StateReads {
    /// `change_log` for fleets of at least [`CHANGE_LOG_MIN_WORKERS`]
    /// workers (counting a PD fleet's prefill workers), `every_worker` below
    /// or with `state_refresh_ms` set.
    Auto,
    /// Read every worker's state (one read per worker per request).
    EveryWorker,
    /// Read the change log, then only the states written since this VM's
    /// last read; every state write appends to the log (`shared_data/changes.rs`).
    ChangeLog,
}

/// Workers from which `state_reads: auto` reads the change log. Each state
/// write then costs two more host calls (the log's read and its write: four
/// per request, the estimate and its release) and each request one read of
/// the log, against one read saved per worker not written since: 10
/// shared-data calls per request against the workers + 4 (`dprank-bench
/// selection` counts both). Natively the log costs about 0.5 us more per
/// request up to 16 workers; at 8 its 2 fewer host calls (1-2 us each
/// inside Envoy) more than pay for that, at 6 there are none fewer.
pub const CHANGE_LOG_MIN_WORKERS: usize = 8;

/// What happens when the filter cannot route a request it should route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailMode {
    /// Pass the request through untouched; the cluster's fallback policy picks.
    Open,
    /// Answer 503 (no load data) or 400 (body not a JSON object).
    Closed,
}

/// How the rank value dprank writes (a body field or rank header) numbers
/// a worker's ranks, where the worker names them from a first rank S above
/// 0 (a node of a multi-node deployment, engines S..S+N-1):
/// docs/vllm.md, "Deployment layouts".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RankNumbering {
    /// Its index among the worker's own ranks, 0..N-1: vLLM's default
    /// (Python) frontend, SGLang's rank ingress.
    Local,
    /// As the worker's reports name it, S..S+N-1: vLLM's Rust frontend.
    Global,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Worker {
    pub name: String,
    pub address: SocketAddr,
    pub dp_size: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    /// This worker's rank numbering, if not the configuration's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank_numbering: Option<RankNumbering>,
    /// One port per rank: rank r is served at `address`'s port + r, and the
    /// port selects it (no rank value is written). SGLang's Rust server.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub rank_ports: bool,
    /// With `rank_ports`: where the worker reports every rank's load; None:
    /// each rank port reports its own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loads_address: Option<SocketAddr>,
}

impl Worker {
    /// `ip:port` as Envoy prints host addresses (the override_host value).
    pub fn endpoint(&self) -> String {
        self.address.to_string()
    }

    /// Where rank index `rank` is served: its own port with `rank_ports`,
    /// else the worker's address.
    pub fn rank_address(&self, rank: u32) -> SocketAddr {
        match self.rank_ports {
            true => SocketAddr::new(
                self.address.ip(),
                self.address
                    .port()
                    .saturating_add(rank.min(u32::from(u16::MAX)) as u16),
            ),
            false => self.address,
        }
    }

    /// Whether `addr` is one of this worker's hosts (its address, or a rank port).
    pub fn serves_at(&self, addr: SocketAddr) -> bool {
        let ports = if self.rank_ports {
            self.dp_size.unwrap_or(1)
        } else {
            1
        };
        addr.ip() == self.address.ip()
            && addr.port() >= self.address.port()
            && u32::from(addr.port() - self.address.port()) < ports
    }

    /// Where the worker's loads are polled: (address, the rank index a
    /// rank port answers for; None: every rank).
    pub fn load_targets(&self) -> Vec<(SocketAddr, Option<u32>)> {
        match (self.rank_ports, self.loads_address) {
            (true, Some(at)) => vec![(at, None)],
            (true, None) => (0..self.dp_size.unwrap_or(1))
                .map(|r| (self.rank_address(r), Some(r)))
                .collect(),
            (false, _) => vec![(self.address, None)],
        }
    }
}

/// Workers taken from an Envoy cluster, read from the admin API's
/// `/clusters?format=json` through `admin_cluster` (a cluster pointing at
/// Envoy's own admin listener on loopback).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Discovery {
    pub cluster: String,
    pub admin_cluster: String,
}

/// Passive health (`passive_health`): when a worker or one of its ranks
/// leaves rotation after failing, and how it comes back (`health.rs`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PassiveHealth {
    /// Failures in a row that eject a worker (or a rank).
    pub consecutive_failures: u32,
    /// The first cooldown; each ejection in a row doubles it.
    pub cooldown_ms: u64,
    pub max_cooldown_ms: u64,
    /// Share of requests for which a worker (or rank) past its cooldown is a
    /// candidate: its probes.
    pub probe_share: f64,
}

/// Where a rank value comes from, for the fields PD mode writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RankOf {
    Prefill,
    Decode,
}

/// PD (prefill/decode disaggregation): two pools and the fields that tie them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pd {
    /// Where requests are forwarded (the route header names one).
    pub decode: Vec<Worker>,
    /// Called out to with the prefill leg.
    pub prefill: Vec<Worker>,
    /// Cluster of the prefill leg (`ORIGINAL_DST`, `use_http_header`).
    pub cluster: String,
    pub timeout_ms: u64,
    /// Rank fields written into the body sent to the prefill worker.
    pub prefill_body_fields: Vec<(String, RankOf)>,
    /// Rank fields written into the body forwarded to the decode worker.
    pub decode_body_fields: Vec<(String, RankOf)>,
}

impl Pd {
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

/// Where the workers come from, and what is done with them.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Regular mode: the workers listed in the configuration.
    StaticWorkers { workers: Vec<Worker> },
    /// Regular mode: the current members of an Envoy cluster (empty until
    /// the first discovery; `discovery.rs` fills them in).
    FromCluster {
        discovery: Discovery,
        #[serde(skip)]
        workers: Vec<Worker>,
    },
    /// Prefill/decode disaggregation.
    Pd(Pd),
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Config {
    /// The engine the workers run: their load source and defaults.
    pub engine: Engine,
    pub mode: Mode,
    pub poll_cluster: String,
    pub route_header: String,
    pub poll_interval_ms: u64,
    pub poll_timeout_ms: u64,
    pub stale_after_ms: u64,
    pub load_endpoint: LoadEndpoint,
    /// Regular mode: the field the chosen rank is written to.
    pub rank_field: String,
    pub cost_estimate: CostEstimate,
    pub fail_mode: FailMode,
    /// How the rank value written numbers a worker's ranks (a worker's own
    /// setting overrides it).
    pub rank_numbering: RankNumbering,
    /// Each streamed answer is timed per (worker, rank): the `delivered.*`
    /// histograms (`request/delivery.rs`).
    pub delivery_timing: bool,
    pub paths: Vec<String>,
    pub keep_client_rank: bool,
    pub pin_header: Option<String>,
    pub state_key: String,
    /// Whether this plugin instance takes part in polling. Off for HTTP filters
    /// when a singleton `WasmService` with the same vm_id and state_key polls.
    pub poll_loads: bool,
    /// Prefix affinity (None: `prefix_affinity: false`, load only).
    pub prefix: Option<Prefix>,
    /// How many gateways share these workers (`config/gateways.rs`).
    pub gateways: u32,
    /// How the scheduler's picker takes one candidate (`config/gateways.rs`).
    pub pick: Pick,
    /// Passive health; None = off.
    pub passive_health: Option<PassiveHealth>,
    /// Listed workers: the cluster whose host health (from the admin API)
    /// dprank respects. `workers_from_cluster` respects it through the
    /// membership instead.
    pub envoy_health: Option<Discovery>,
    /// How many other workers with the chosen rank the route header names
    /// after the chosen one, for Envoy's retries.
    pub retry_alternates: u32,
    /// 0: every request reads every worker's state. N: a VM reads them all at
    /// most every N ms, and in between only those whose cas it does not know
    /// (after its own write, or a failed compare-and-swap); the chosen
    /// worker's state is still written by compare-and-swap against the
    /// latest, so only other VMs' estimates are seen up to N ms late.
    pub state_refresh_ms: u64,
    /// How the states are read per request (see [`Config::reads_change_log`]).
    pub state_reads: StateReads,
    /// Where the chosen rank travels: the JSON body or request headers.
    pub transport: Transport,
    /// Overload protection (`config/admission.rs`); None = off.
    pub admission: Option<Admission>,
    /// Client request headers removed from every request: the route header,
    /// the pin header, every rank and bootstrap header (derived, not configured).
    #[serde(skip)]
    pub removed_headers: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration is not valid: {0}")]
    Json(String),
    #[error("configuration key `{key}`: {reason}")]
    Invalid { key: String, reason: String },
}

impl Config {
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
        objects_where_expected(&value)?;
        let json: ConfigJson = serde_json::from_slice(bytes).map_err(|e| ConfigError::Json(e.to_string()))?;
        Config::try_from(json)
    }

    /// The effective configuration as one line of JSON (the start-up log).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Header mode's settings, if the rank travels in headers.
    pub fn header_transport(&self) -> Option<&HeaderTransport> {
        match &self.transport {
            Transport::Header(h) => Some(h),
            Transport::Body => None,
        }
    }

    /// Header mode's settings when the choice is made as the request
    /// headers arrive (no prefix affinity: the body is never read).
    pub fn decides_at_headers(&self) -> Option<&HeaderTransport> {
        self.header_transport().filter(|h| !h.reads_body)
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

    /// The pool requests are forwarded to: the listed or discovered workers,
    /// or the decode pool in PD mode.
    pub fn routed(&self) -> &[Worker] {
        match &self.mode {
            Mode::StaticWorkers { workers } | Mode::FromCluster { workers, .. } => workers,
            Mode::Pd(pd) => &pd.decode,
        }
    }

    /// PD mode's settings, if in PD mode.
    pub fn pd(&self) -> Option<&Pd> {
        match &self.mode {
            Mode::Pd(pd) => Some(pd),
            _ => None,
        }
    }

    /// The cluster whose membership gives the workers, if any.
    pub fn discovery(&self) -> Option<&Discovery> {
        match &self.mode {
            Mode::FromCluster { discovery, .. } => Some(discovery),
            _ => None,
        }
    }

    /// This configuration with a cluster's current members as its workers
    /// (unchanged outside `FromCluster` mode).
    pub fn with_members(&self, members: Vec<Worker>) -> Config {
        let mut config = self.clone();
        if let Mode::FromCluster { workers, .. } = &mut config.mode {
            *workers = members;
        }
        config
    }

    /// The prefill pool's place in `all_workers` (it follows the routed pool).
    pub fn prefill_offset(&self) -> usize {
        self.routed().len()
    }

    /// Whether worker `index` (`all_workers` order) keeps a prefix index:
    /// with prefix affinity, the pool whose rank it chooses (PD's prefill
    /// pool, otherwise the routed one).
    pub fn keeps_prefix_index(&self, index: usize) -> bool {
        self.prefix.is_some()
            && match self.pd() {
                Some(_) => index >= self.prefill_offset(),
                None => true,
            }
    }

    /// A worker by its index in `all_workers`.
    pub fn worker(&self, index: usize) -> Option<&Worker> {
        self.all_workers().nth(index)
    }

    /// The address of the worker that serves at `addr` (one of its rank
    /// ports, or its address); `addr` itself when none does.
    pub fn worker_address_of(&self, addr: SocketAddr) -> SocketAddr {
        self.all_workers()
            .find(|w| w.serves_at(addr))
            .map_or(addr, |w| w.address)
    }

    /// Every polled worker: the routed pool, then the prefill pool in PD mode.
    /// Shared state is indexed this way.
    pub fn all_workers(&self) -> impl Iterator<Item = &Worker> {
        self.routed()
            .iter()
            .chain(self.pd().into_iter().flat_map(|p| p.prefill.iter()))
    }

    /// Whether state writes are logged and reads follow the change log
    /// (`state_reads`, resolved for this configuration's fleet size). Every
    /// VM following the same configuration agrees.
    pub fn reads_change_log(&self) -> bool {
        match self.state_reads {
            StateReads::EveryWorker => false,
            StateReads::ChangeLog => true,
            StateReads::Auto => {
                self.state_refresh_ms == 0
                    && self.routed().len() + self.pd().map_or(0, |p| p.prefill.len())
                        >= CHANGE_LOG_MIN_WORKERS
            }
        }
    }

    /// Whether routing needs the health record: passive health or Envoy's view.
    pub fn reads_health(&self) -> bool {
        self.passive_health.is_some() || self.envoy_health.is_some()
    }

    pub fn routes_path(&self, path: &str) -> bool {
        let path = path.split('?').next().unwrap_or(path);
        self.paths.iter().any(|p| p == path)
    }
}

#[cfg(test)]
mod tests;

/// serde takes a JSON array for a struct, field by field in order: refuse
/// one wherever the configuration has an object (the whole configuration,
/// `passive_health`, `discovery`, `admission`, each listed worker), so
/// `[null, "x"]` is not read as `served_model_name: "x"`.
fn objects_where_expected(value: &serde_json::Value) -> Result<(), ConfigError> {
    let Some(root) = value.as_object() else {
        return Err(ConfigError::Json(
            "the configuration must be a JSON object".into(),
        ));
    };
    let not_object = |key: String| ConfigError::Invalid {
        key,
        reason: "must be an object".into(),
    };
    for key in ["passive_health", "discovery", "admission"] {
        if root.get(key).is_some_and(|v| v.is_array()) {
            return Err(not_object(key.to_string()));
        }
    }
    for key in ["workers", "prefill_workers", "decode_workers"] {
        let mut workers = root.get(key).and_then(|v| v.as_array()).into_iter().flatten();
        if let Some(i) = workers.position(|w| w.is_array()) {
            return Err(not_object(format!("{key}[{i}]")));
        }
    }
    Ok(())
}
