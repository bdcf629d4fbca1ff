//! Prefix affinity's settings (docs/prefix-affinity.md): the keys, their
//! defaults and their validation.

use super::json::ConfigJson;
use super::{ConfigError, EngineKind, RankTransport};
use serde::{Deserialize, Serialize};

/// Bytes of routed text per index block.
pub const DEFAULT_BLOCK_BYTES: u32 = 512;
pub const MIN_BLOCK_BYTES: u32 = 64;
pub const MAX_BLOCK_BYTES: u32 = 16384;
/// Index capacity per rank, in tokens, when neither the configuration nor
/// the rank's load report (`max_total_num_tokens`) gives one.
pub const DEFAULT_CAPACITY_TOKENS: u64 = 131_072;
/// Largest capacity accepted (bounds the shared data a rank's index takes).
pub const MAX_CAPACITY_TOKENS: u64 = 16 << 20;
pub const DEFAULT_TTL_MS: u64 = 600_000;
pub const MIN_TTL_MS: u64 = 1000;
/// Longest TTL (an hour): the index's stamps hold it with room to spare
/// (`prefix/index.rs` checks so when it is compiled).
pub const MAX_TTL_MS: u64 = 3_600_000;
pub const DEFAULT_UNCACHED_WEIGHT: f64 = 1.0;
pub const DEFAULT_LOAD_WEIGHT: f64 = 0.1;
pub const DEFAULT_WAIT_WEIGHT: f64 = 0.0;
pub const DEFAULT_KV_WEIGHT: f64 = 1.0;
pub const DEFAULT_PRIVATE_WEIGHT: f64 = 25.0;
pub const DEFAULT_PRIVATE_AFTER_MS: u64 = 3000;
/// The lockstep rule's defaults (`Lockstep`), chosen on tuning seeds
/// (docs/prefix-affinity.md, docs/prefix-affinity-results.md).
pub const DEFAULT_LOCKSTEP_RAISE_WEIGHT: f64 = 0.75;
pub const DEFAULT_LOCKSTEP_MAX_FULLNESS: f64 = 2.0;
pub const DEFAULT_LOCKSTEP_RUNNING_TOKENS: u64 = 3_000;
pub const DEFAULT_LOCKSTEP_HORIZON_WEIGHT: f64 = 0.5;
pub const DEFAULT_LOCKSTEP_RANK_WEIGHT: f64 = 0.05;
/// Most blocks a rank's index keeps, whatever its capacity (bounds the
/// shared data one worker's index takes: 8 bytes per block).
pub const MAX_BLOCKS_PER_RANK: usize = 1 << 16;
/// Largest weight accepted: beyond it one term drowns every other.
pub const MAX_WEIGHT: f64 = 100_000.0;

/// How the prefill work queued on a rank is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueMeasure {
    /// This gateway's own requests on the rank whose first response byte has
    /// not come back (non-streamed ones until a poll has seen them).
    Local,
    /// The rank's polled `num_waiting_uncached_tokens`, plus this gateway's
    /// requests sent since that poll left, minus those of its requests the
    /// poll counted that have started answering since.
    Polled,
    /// The larger of the two.
    Max,
}

/// How a rank's load counts against a request under prefix affinity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadMeasure {
    /// The rank's own tokens.
    Rank,
    /// The tokens of the worker's most loaded rank once the request is
    /// added: under DP attention every rank of a worker steps as slowly as
    /// that one, so a request slows its decode only by raising it.
    SlowestRank,
    /// `SlowestRank` for a prompt no rank is thought to hold (nothing to
    /// keep together: only the lockstep matters), `Rank` for the others.
    SlowestRankWhenUncached,
}

impl LoadMeasure {
    /// Whether the lockstep rule costs a request's ranks (else each rank's
    /// own tokens do): always under `SlowestRank`; under
    /// `SlowestRankWhenUncached` for a prompt `held_nowhere`.
    pub fn lockstep(self, held_nowhere: bool) -> bool {
        match self {
            LoadMeasure::SlowestRank => true,
            LoadMeasure::SlowestRankWhenUncached => held_nowhere,
            LoadMeasure::Rank => false,
        }
    }
}

/// The lockstep rule's terms (`prefix_load` `slowest_rank`, or
/// `slowest_rank_when_uncached` for a prompt no rank holds: the `lockstep`
/// scorer, docs/prefix-affinity.md).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Lockstep {
    /// How much raising a worker's slowest rank costs, per rank it slows,
    /// when that rank is full (`prefix_lockstep_raise_weight`).
    pub raise_weight: f64,
    /// The slowest rank's tokens count at most this many times its capacity
    /// (they include queued prompts, which can exceed it;
    /// `prefix_lockstep_max_fullness`).
    pub max_fullness: f64,
    /// Tokens each request a rank reports running counts as, on top of its
    /// tokens: a decode step's time grows with its sequences, not only their
    /// KV tokens (`prefix_lockstep_running_tokens`).
    pub running_tokens: u64,
    /// Weight of the worker's prefill horizon: the longest prefill queued on
    /// any of its ranks, or the rank's queue plus the prompt when that is
    /// longer (`prefix_lockstep_horizon_weight`).
    pub horizon_weight: f64,
    /// Weight of a rank's own load above its worker's least loaded rank:
    /// among the ranks of one worker, which the rest of the rule costs
    /// alike, the less loaded is chosen (`prefix_lockstep_rank_weight`).
    pub rank_weight: f64,
}

impl Default for Lockstep {
    fn default() -> Lockstep {
        Lockstep {
            raise_weight: DEFAULT_LOCKSTEP_RAISE_WEIGHT,
            max_fullness: DEFAULT_LOCKSTEP_MAX_FULLNESS,
            running_tokens: DEFAULT_LOCKSTEP_RUNNING_TOKENS,
            horizon_weight: DEFAULT_LOCKSTEP_HORIZON_WEIGHT,
            rank_weight: DEFAULT_LOCKSTEP_RANK_WEIGHT,
        }
    }
}

/// `prefix_load` when the configuration leaves it out. SGLang's DP-attention
/// ranks step together, so a prompt no rank holds is costed by the lockstep
/// (judged in docs/prefix-affinity-results.md); vLLM's dense DP engines step on
/// their own, so each is costed by its own tokens.
pub fn default_load(engine: EngineKind) -> LoadMeasure {
    match engine {
        EngineKind::Sglang => LoadMeasure::SlowestRankWhenUncached,
        EngineKind::Vllm => LoadMeasure::Rank,
    }
}

/// Prefix affinity: requests go to the (worker, rank) with the least
/// expected cost, counting the prompt the rank is thought to hold in cache.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prefix {
    /// Bytes of routed text per block of the index.
    pub block_bytes: u32,
    /// Index capacity per rank in tokens; None: the rank's reported
    /// `max_total_num_tokens`, else `DEFAULT_CAPACITY_TOKENS`.
    pub capacity_tokens: Option<u64>,
    /// Index entries not routed to for this long are forgotten.
    pub ttl_ms: u64,
    /// Cost per uncached prompt token of the request itself.
    pub uncached_weight: f64,
    /// Cost per token of the rank's polled load (`num_total_tokens`) plus
    /// this gateway's estimates: what the rank's running batch and queue hold.
    pub load_weight: f64,
    /// Cost per request queued on the rank (waiting for its first token),
    /// in tokens: what a request's admission costs beyond its prefill
    /// when the rank is full (KV or running slots).
    pub wait_weight: f64,
    /// Cost per token of KV the request would lack on the rank.
    pub kv_weight: f64,
    /// Cost per prompt token a request would recompute by leaving the rank
    /// holding the deepest match of its prompt, when that match is private
    /// (instead of `uncached_weight`; no more when it is lower).
    pub private_weight: f64,
    /// A match is private when its deepest block was last routed at least
    /// this long ago: one conversation's history, not a prompt many
    /// requests share (those are routed again within a second or two).
    pub private_after_ms: u64,
    pub queue: QueueMeasure,
    pub load: LoadMeasure,
    /// The lockstep rule's terms, where `load` applies it.
    pub lockstep: Lockstep,
}

/// The defaults for SGLang, the default engine.
impl Default for Prefix {
    fn default() -> Prefix {
        Prefix {
            block_bytes: DEFAULT_BLOCK_BYTES,
            capacity_tokens: None,
            ttl_ms: DEFAULT_TTL_MS,
            uncached_weight: DEFAULT_UNCACHED_WEIGHT,
            load_weight: DEFAULT_LOAD_WEIGHT,
            wait_weight: DEFAULT_WAIT_WEIGHT,
            kv_weight: DEFAULT_KV_WEIGHT,
            private_weight: DEFAULT_PRIVATE_WEIGHT,
            private_after_ms: DEFAULT_PRIVATE_AFTER_MS,
            queue: QueueMeasure::Max,
            load: default_load(EngineKind::default()),
            lockstep: Lockstep::default(),
        }
    }
}

fn invalid(key: &str, reason: String) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        reason,
    }
}

fn weight(key: &str, value: Option<f64>, default: f64) -> Result<f64, ConfigError> {
    let w = value.unwrap_or(default);
    if !(w.is_finite() && (0.0..=MAX_WEIGHT).contains(&w)) {
        return Err(invalid(
            key,
            format!("must be a number in 0..={MAX_WEIGHT}, got {w}"),
        ));
    }
    Ok(w)
}

/// `prefix_affinity` and its tuning keys: None when affinity is off (the
/// tuning keys are then refused, as they would do nothing). Off by default
/// under `rank_transport: header`, so that the body streams through unread;
/// on there, the body is read for the prompt (and never changed).
pub fn settings(json: &ConfigJson) -> Result<Option<Prefix>, ConfigError> {
    let tuning = [
        ("prefix_block_bytes", json.prefix_block_bytes.is_some()),
        ("prefix_capacity_tokens", json.prefix_capacity_tokens.is_some()),
        ("prefix_ttl_ms", json.prefix_ttl_ms.is_some()),
        ("prefix_uncached_weight", json.prefix_uncached_weight.is_some()),
        ("prefix_load_weight", json.prefix_load_weight.is_some()),
        ("prefix_wait_weight", json.prefix_wait_weight.is_some()),
        ("prefix_kv_weight", json.prefix_kv_weight.is_some()),
        ("prefix_queue", json.prefix_queue.is_some()),
        ("prefix_load", json.prefix_load.is_some()),
        ("prefix_private_weight", json.prefix_private_weight.is_some()),
        ("prefix_private_after_ms", json.prefix_private_after_ms.is_some()),
    ];
    let header = matches!(json.rank_transport, Some(RankTransport::Header));
    if !json.prefix_affinity.unwrap_or(!header) {
        return match tuning.iter().chain(&lockstep_keys(json)).find(|(_, set)| *set) {
            Some((key, _)) => Err(invalid(key, "applies only with prefix_affinity: true".into())),
            None => Ok(None),
        };
    }
    let block_bytes = json.prefix_block_bytes.unwrap_or(DEFAULT_BLOCK_BYTES);
    if !(MIN_BLOCK_BYTES..=MAX_BLOCK_BYTES).contains(&block_bytes) {
        return Err(invalid(
            "prefix_block_bytes",
            format!("must be {MIN_BLOCK_BYTES}..={MAX_BLOCK_BYTES}, got {block_bytes}"),
        ));
    }
    if let Some(c) = json.prefix_capacity_tokens {
        if c == 0 || c > MAX_CAPACITY_TOKENS {
            return Err(invalid(
                "prefix_capacity_tokens",
                format!("must be 1..={MAX_CAPACITY_TOKENS}, got {c}"),
            ));
        }
    }
    let ttl_ms = json.prefix_ttl_ms.unwrap_or(DEFAULT_TTL_MS);
    if !(MIN_TTL_MS..=MAX_TTL_MS).contains(&ttl_ms) {
        return Err(invalid(
            "prefix_ttl_ms",
            format!("must be {MIN_TTL_MS}..={MAX_TTL_MS}, got {ttl_ms}"),
        ));
    }
    // Past the TTL nothing is matched: the default stays within it.
    let private_after_ms = json
        .prefix_private_after_ms
        .unwrap_or(DEFAULT_PRIVATE_AFTER_MS.min(ttl_ms));
    if !(MIN_TTL_MS..=ttl_ms).contains(&private_after_ms) {
        return Err(invalid(
            "prefix_private_after_ms",
            format!("must be {MIN_TTL_MS}..=prefix_ttl_ms ({ttl_ms}), got {private_after_ms}"),
        ));
    }
    let load = json
        .prefix_load
        .unwrap_or_else(|| default_load(json.engine.unwrap_or_default()));
    let lockstep = lockstep(json, load)?;
    Ok(Some(Prefix {
        block_bytes,
        capacity_tokens: json.prefix_capacity_tokens,
        ttl_ms,
        uncached_weight: weight(
            "prefix_uncached_weight",
            json.prefix_uncached_weight,
            DEFAULT_UNCACHED_WEIGHT,
        )?,
        load_weight: weight("prefix_load_weight", json.prefix_load_weight, DEFAULT_LOAD_WEIGHT)?,
        wait_weight: weight("prefix_wait_weight", json.prefix_wait_weight, DEFAULT_WAIT_WEIGHT)?,
        kv_weight: weight("prefix_kv_weight", json.prefix_kv_weight, DEFAULT_KV_WEIGHT)?,
        private_weight: weight(
            "prefix_private_weight",
            json.prefix_private_weight,
            DEFAULT_PRIVATE_WEIGHT,
        )?,
        private_after_ms,
        queue: json.prefix_queue.unwrap_or(QueueMeasure::Max),
        load,
        lockstep,
    }))
}

/// The lockstep rule's keys, and whether each is set.
fn lockstep_keys(json: &ConfigJson) -> [(&'static str, bool); 5] {
    [
        (
            "prefix_lockstep_raise_weight",
            json.prefix_lockstep_raise_weight.is_some(),
        ),
        (
            "prefix_lockstep_max_fullness",
            json.prefix_lockstep_max_fullness.is_some(),
        ),
        (
            "prefix_lockstep_running_tokens",
            json.prefix_lockstep_running_tokens.is_some(),
        ),
        (
            "prefix_lockstep_horizon_weight",
            json.prefix_lockstep_horizon_weight.is_some(),
        ),
        (
            "prefix_lockstep_rank_weight",
            json.prefix_lockstep_rank_weight.is_some(),
        ),
    ]
}

/// The lockstep rule's terms under `load`: refused where it never applies.
fn lockstep(json: &ConfigJson, load: LoadMeasure) -> Result<Lockstep, ConfigError> {
    if load == LoadMeasure::Rank {
        if let Some((key, _)) = lockstep_keys(json).iter().find(|(_, set)| *set) {
            return Err(invalid(
                key,
                "applies only with prefix_load slowest_rank or slowest_rank_when_uncached".into(),
            ));
        }
    }
    let running_tokens = json
        .prefix_lockstep_running_tokens
        .unwrap_or(DEFAULT_LOCKSTEP_RUNNING_TOKENS);
    if running_tokens > MAX_CAPACITY_TOKENS {
        return Err(invalid(
            "prefix_lockstep_running_tokens",
            format!("must be 0..={MAX_CAPACITY_TOKENS}, got {running_tokens}"),
        ));
    }
    Ok(Lockstep {
        raise_weight: weight(
            "prefix_lockstep_raise_weight",
            json.prefix_lockstep_raise_weight,
            DEFAULT_LOCKSTEP_RAISE_WEIGHT,
        )?,
        max_fullness: weight(
            "prefix_lockstep_max_fullness",
            json.prefix_lockstep_max_fullness,
            DEFAULT_LOCKSTEP_MAX_FULLNESS,
        )?,
        running_tokens,
        horizon_weight: weight(
            "prefix_lockstep_horizon_weight",
            json.prefix_lockstep_horizon_weight,
            DEFAULT_LOCKSTEP_HORIZON_WEIGHT,
        )?,
        rank_weight: weight(
            "prefix_lockstep_rank_weight",
            json.prefix_lockstep_rank_weight,
            DEFAULT_LOCKSTEP_RANK_WEIGHT,
        )?,
    })
}

impl Prefix {
    /// Index capacity of a rank in blocks, from its reported KV capacity.
    pub fn capacity_blocks(&self, reported_tokens: Option<u64>) -> usize {
        let tokens = self
            .capacity_tokens
            .or(reported_tokens.filter(|t| *t > 0))
            .unwrap_or(DEFAULT_CAPACITY_TOKENS)
            .min(MAX_CAPACITY_TOKENS);
        // A block holds about block_bytes / 4 tokens (the `bytes` estimate).
        let blocks = tokens.saturating_mul(4) / u64::from(self.block_bytes);
        (blocks as usize).clamp(1, MAX_BLOCKS_PER_RANK)
    }
}
