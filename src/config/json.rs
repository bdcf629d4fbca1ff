//! The configuration as users write it: serde structs, every field optional
//! so that validation (`validate.rs`) can name what is missing or wrong.

use super::{
    CostEstimate, EngineKind, FailMode, LoadEndpoint, LoadMeasure, Naming, PickRule, QueueMeasure,
    RankNumbering, RankTransport, StateReads,
};
use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigJson {
    /// `sglang` (default) or `vllm` (`config/engine.rs`).
    #[serde(default)]
    pub engine: Option<EngineKind>,
    /// vLLM: the `model_name` whose figures are read.
    #[serde(default)]
    pub served_model_name: Option<String>,
    /// Regular mode: the workers requests are routed to.
    #[serde(default)]
    pub workers: Option<Vec<WorkerJson>>,
    /// Regular mode: follow an Envoy cluster's membership instead of `workers`.
    #[serde(default)]
    pub workers_from_cluster: Option<DiscoveryJson>,
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
    /// `local` (default) or `global`: how the rank value written numbers a
    /// worker's ranks named from a first rank above 0.
    #[serde(default)]
    pub rank_numbering: Option<RankNumbering>,
    /// Time each streamed answer per (worker, rank) (default true).
    #[serde(default)]
    pub delivery_timing: Option<bool>,
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
    /// Prefix affinity and its tuning (`config/prefix.rs`).
    #[serde(default)]
    pub prefix_affinity: Option<bool>,
    #[serde(default)]
    pub prefix_block_bytes: Option<u32>,
    #[serde(default)]
    pub prefix_capacity_tokens: Option<u64>,
    #[serde(default)]
    pub prefix_ttl_ms: Option<u64>,
    #[serde(default)]
    pub prefix_uncached_weight: Option<f64>,
    #[serde(default)]
    pub prefix_load_weight: Option<f64>,
    #[serde(default)]
    pub prefix_wait_weight: Option<f64>,
    #[serde(default)]
    pub prefix_kv_weight: Option<f64>,
    #[serde(default)]
    pub prefix_queue: Option<QueueMeasure>,
    #[serde(default)]
    pub prefix_load: Option<LoadMeasure>,
    #[serde(default)]
    pub prefix_private_weight: Option<f64>,
    #[serde(default)]
    pub prefix_private_after_ms: Option<u64>,
    #[serde(default)]
    pub prefix_lockstep_raise_weight: Option<f64>,
    #[serde(default)]
    pub prefix_lockstep_max_fullness: Option<f64>,
    #[serde(default)]
    pub prefix_lockstep_running_tokens: Option<u64>,
    #[serde(default)]
    pub prefix_lockstep_horizon_weight: Option<f64>,
    #[serde(default)]
    pub prefix_lockstep_rank_weight: Option<f64>,
    /// Several gateways: how many, the picker and its choices (`config/gateways.rs`).
    #[serde(default)]
    pub gateways: Option<u32>,
    #[serde(default)]
    pub pick: Option<PickRule>,
    #[serde(default)]
    pub pick_choices: Option<u32>,
    #[serde(default)]
    pub passive_health: Option<PassiveHealthJson>,
    /// Listed workers: respect the host health Envoy has for this cluster.
    #[serde(default)]
    pub envoy_health: Option<DiscoveryJson>,
    #[serde(default)]
    pub retry_alternates: Option<u32>,
    /// How often a VM re-reads the states of workers it is not writing (0:
    /// every request).
    #[serde(default)]
    pub state_refresh_ms: Option<u64>,
    /// `auto` (default), `every_worker` or `change_log`.
    #[serde(default)]
    pub state_reads: Option<StateReads>,
    /// `body` (default) or `header`: where the chosen rank is written.
    #[serde(default)]
    pub rank_transport: Option<RankTransport>,
    /// Header mode: the headers the chosen rank is written to.
    #[serde(default)]
    pub rank_headers: Option<Vec<String>>,
    /// Header mode: tokens counted for a request without `content-length`.
    #[serde(default)]
    pub cost_without_length: Option<u64>,
    /// Overload protection (`config/admission.rs`).
    #[serde(default)]
    pub admission: Option<super::admission::AdmissionJson>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassiveHealthJson {
    /// false turns passive health off.
    #[serde(default)]
    pub enabled: Option<bool>,
    #[serde(default)]
    pub consecutive_failures: Option<u32>,
    #[serde(default)]
    pub cooldown_ms: Option<u64>,
    #[serde(default)]
    pub max_cooldown_ms: Option<u64>,
    #[serde(default)]
    pub probe_share: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryJson {
    pub cluster: String,
    #[serde(default)]
    pub admin_cluster: Option<String>,
}

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
    /// This worker's `rank_numbering`, if not the configuration's.
    #[serde(default)]
    pub rank_numbering: Option<RankNumbering>,
    /// One port per rank (`address`'s port + r); needs `dp_size`.
    #[serde(default)]
    pub rank_ports: Option<bool>,
    /// With `rank_ports`: a worker-level load endpoint (`ip:port`).
    #[serde(default)]
    pub loads_address: Option<String>,
}
