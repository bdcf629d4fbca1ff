//! Load sources: what a worker's engine is asked for its load, and how its
//! answer is read into one [`LoadReport`]. The poller asks the source what
//! to request and hands it the answer; it knows no engine. Two engines:
//! SGLang (`sglang.rs`) and vLLM (`vllm.rs`, its figures mapped in
//! `vllm/mapping.rs`); another is a module beside them and a [`Source`]
//! variant (docs/architecture.md). What a source needs between polls is its
//! [`SourceMemory`], kept in the worker's state.

pub mod prometheus;
pub mod sglang;
pub mod vllm;

use crate::config::{Config, Engine, MAX_DP_SIZE};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The window a rank's cache hit rate covers: SGLang reports its own over
/// its last 15 s of admissions (`SGLANG_CACHE_HIT_RATE_WINDOW_SECONDS`);
/// vLLM's is worked out from its counters over the same.
pub const HIT_RATE_WINDOW_MS: u64 = 15_000;

/// What one engine reports about each of its data-parallel ranks, by rank
/// (index = rank); a figure the report did not give, or gave unusably, is
/// None. The load-balancing figure is `tokens`; the rest feed prefix
/// affinity, or are carried for sources and rules that read them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankLoad {
    /// Tokens the rank holds: in use plus queued (the figure ranks are compared by).
    pub tokens: Option<u64>,
    pub waiting_requests: Option<u64>,
    pub running_requests: Option<u64>,
    /// Prompt tokens of the waiting requests that the rank's cache does not hold.
    pub waiting_uncached_tokens: Option<u64>,
    /// KV tokens in use.
    pub used_tokens: Option<u64>,
    /// The rank's KV capacity in tokens.
    pub capacity_tokens: Option<u64>,
    /// KV in use as a share of capacity, 0..=1.
    pub kv_usage: Option<f64>,
    /// Share of admitted prompt tokens found in the cache lately, 0..=1.
    pub cache_hit_rate: Option<f64>,
}

/// One worker's answer, rank by rank: `ranks[i]` is the rank the server
/// names `first_rank + i` (N ranks, at most `MAX_DP_SIZE`). A server that
/// manages part of a larger group names its ranks from the group's
/// numbering: vLLM's second node of a DP-8 deployment, engines 4..7.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
    pub first_rank: u32,
    pub ranks: Vec<RankLoad>,
}

impl LoadReport {
    /// The load-balancing figure per rank.
    pub fn tokens(&self) -> Vec<Option<u64>> {
        self.ranks.iter().map(|r| r.tokens).collect()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadError {
    NotJson(String),
    NoRanks,
    RankOutOfRange(u64),
    /// The ranks are not one run S..S+N-1 (a duplicate, a gap, or a
    /// `dp_rank` that is not a rank number).
    BadRanks(String),
}

/// The ranks a report names, checked to be one run S..S+N-1 (no gap, no
/// rank twice) of at most `MAX_DP_SIZE` ranks, numbered below
/// `MAX_RANK_NUMBER`: (S, N). `count` is the rank count the report states,
/// if any: with S = 0 it must be N (a report missing its top ranks is
/// refused, not shrunk); above, at least N (a rank port states its own one
/// rank, a node's ingress its own ranks or the group's).
pub fn rank_run(ranks: impl IntoIterator<Item = u64>, count: Option<u64>) -> Result<(u32, u32), LoadError> {
    let mut listed: Vec<u64> = ranks.into_iter().collect();
    if listed.is_empty() {
        return Err(LoadError::NoRanks);
    }
    listed.sort_unstable();
    if let Some(twice) = listed.windows(2).find(|w| w[0] == w[1]) {
        return Err(LoadError::BadRanks(format!("rank {} listed twice", twice[0])));
    }
    let (first, last) = (listed[0], listed[listed.len() - 1]);
    if last >= u64::from(MAX_RANK_NUMBER) {
        return Err(LoadError::RankOutOfRange(last));
    }
    let n = listed.len() as u64;
    if n > u64::from(MAX_DP_SIZE) {
        return Err(LoadError::RankOutOfRange(n));
    }
    if let Some(gap) = listed.windows(2).find(|w| w[1] != w[0] + 1) {
        return Err(LoadError::BadRanks(format!(
            "no rank {} between {} and {}",
            gap[0] + 1,
            gap[0],
            gap[1]
        )));
    }
    match count {
        Some(count) if count < n || (first == 0 && count < last + 1) => {
            return Err(LoadError::BadRanks(format!("rank {last} with {count} ranks")));
        }
        Some(count) if first == 0 && count > n => {
            return Err(LoadError::BadRanks(format!("no entry for rank {n} of {count}")));
        }
        _ => {}
    }
    Ok((first as u32, n as u32))
}

/// The highest rank number a report may name (a group's global numbering:
/// 65536 ranks).
pub const MAX_RANK_NUMBER: u32 = 1 << 16;

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotJson(e) => write!(f, "load report is not a known JSON shape: {e}"),
            LoadError::NoRanks => write!(f, "load report lists no ranks"),
            LoadError::RankOutOfRange(r) => {
                write!(f, "load report names dp_rank {r} (limit {MAX_DP_SIZE})")
            }
            LoadError::BadRanks(why) => write!(
                f,
                "load report refused: its ranks are not one run S..S+N-1 ({why})"
            ),
        }
    }
}

/// What one load poll asks the worker for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Poll {
    pub path: &'static str,
    /// The `accept` header.
    pub accept: &'static str,
}

/// What a worker's answer to a [`Poll`] means.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    Report(Reading),
    /// The endpoint does not exist on this worker: poll it again at once on
    /// the source's fallback, and from now on (`SourceMemory::fallback`).
    FallBack,
    /// A report whose ranks cannot be trusted: not applied, logged once.
    Refused(String),
    /// Nothing usable (an HTTP error, a body that is not a report).
    Failed(String),
}

/// A readable answer, before what needs the worker's memory and this
/// gateway's estimates is worked out ([`Reading::report`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Reading {
    /// A report complete in itself (SGLang's, in tokens).
    Complete(LoadReport),
    /// vLLM's per-engine figures (requests, a share of KV, counters).
    Vllm(vllm::VllmReport),
}

/// What a report's figures are worked out with, besides the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportContext {
    /// When the answer came (ms since the epoch).
    pub now_ms: u64,
    /// This gateway's mean estimate of a request routed to the worker, in
    /// tokens: what a request the engine counts but does not size weighs.
    pub request_tokens: u64,
}

impl Reading {
    /// The report, per rank; `memory` (the worker's) learns this poll.
    pub fn report(&self, memory: &mut SourceMemory, context: &ReportContext) -> LoadReport {
        match self {
            Reading::Complete(report) => report.clone(),
            Reading::Vllm(figures) => vllm::mapping::rank_loads(figures, &mut memory.prefix_cache, context),
        }
    }
}

/// What a load source keeps of a worker between polls, in the worker's
/// state (so whichever thread polls next knows).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceMemory {
    /// The source fell back to its second endpoint for this worker (SGLang
    /// under `load_endpoint: auto`: no `/v1/loads`, poll `/get_load`).
    pub fallback: bool,
    /// vLLM: the prefix-cache counters of the last poll, for the hit rate.
    pub prefix_cache: vllm::mapping::CacheCounters,
}

impl SourceMemory {
    /// Whether the sizes are within what dprank ever writes.
    pub fn within_limits(&self, max_ranks: usize) -> bool {
        self.prefix_cache.within_limits(max_ranks)
    }
}

/// An engine's load endpoint.
pub trait LoadSource {
    /// The poll of a worker, given what the source remembers of it.
    fn poll(&self, memory: &SourceMemory) -> Poll;
    /// What the worker's answer to `poll` (HTTP `status`, `body`) means.
    fn answer(&self, poll: &Poll, status: u32, body: &[u8]) -> Answer;
}

/// The load source of a configuration, dispatched statically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source<'c> {
    Sglang(sglang::Sglang),
    Vllm(vllm::Vllm<'c>),
}

impl Source<'_> {
    pub fn of(config: &Config) -> Source<'_> {
        match &config.engine {
            Engine::Sglang => Source::Sglang(sglang::Sglang {
                endpoint: config.load_endpoint,
            }),
            Engine::Vllm { served_model_name } => Source::Vllm(vllm::Vllm {
                model: served_model_name.as_deref(),
            }),
        }
    }
}

impl LoadSource for Source<'_> {
    fn poll(&self, memory: &SourceMemory) -> Poll {
        match self {
            Source::Sglang(s) => s.poll(memory),
            Source::Vllm(s) => s.poll(memory),
        }
    }

    fn answer(&self, poll: &Poll, status: u32, body: &[u8]) -> Answer {
        match self {
            Source::Sglang(s) => s.answer(poll, status, body),
            Source::Vllm(s) => s.answer(poll, status, body),
        }
    }
}
