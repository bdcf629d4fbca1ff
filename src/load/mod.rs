//! Load sources: what a worker's engine is asked for its load, and how its
//! answer is read into one [`LoadReport`]. The poller asks the source what
//! to request and hands it the answer; it knows no engine. One engine
//! today, SGLang (`sglang.rs`); another is a module beside it and a
//! [`Source`] variant (docs/architecture.md).

pub mod prometheus;
pub mod sglang;
pub mod vllm;

use crate::config::{Config, MAX_DP_SIZE};
use std::fmt;

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

/// One worker's answer, rank by rank (ranks 0..N-1, N at most `MAX_DP_SIZE`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
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
    /// The ranks are not exactly 0..N-1 (another rank, a duplicate, a gap,
    /// or a `dp_rank` that is not a rank number).
    BadRanks(String),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotJson(e) => write!(f, "load report is not a known JSON shape: {e}"),
            LoadError::NoRanks => write!(f, "load report lists no ranks"),
            LoadError::RankOutOfRange(r) => {
                write!(f, "load report names dp_rank {r} (limit {MAX_DP_SIZE})")
            }
            LoadError::BadRanks(why) => write!(f, "load report refused: its ranks are not 0..N-1 ({why})"),
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
    Report(LoadReport),
    /// The endpoint does not exist on this worker: poll it again at once on
    /// the source's fallback, and from now on (`WorkerState::load_fallback`).
    FallBack,
    /// A report whose ranks cannot be trusted: not applied, logged once.
    Refused(String),
    /// Nothing usable (an HTTP error, a body that is not a report).
    Failed(String),
}

/// An engine's load endpoint.
pub trait LoadSource {
    /// The poll of a worker; `fallback`: its state says an earlier answer
    /// sent it to the source's fallback endpoint.
    fn poll(&self, fallback: bool) -> Poll;
    /// What the worker's answer to `poll` (HTTP `status`, `body`) means.
    fn answer(&self, poll: &Poll, status: u32, body: &[u8]) -> Answer;
}

/// The load source of a configuration, dispatched statically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Sglang(sglang::Sglang),
}

impl Source {
    pub fn of(config: &Config) -> Source {
        Source::Sglang(sglang::Sglang {
            endpoint: config.load_endpoint,
        })
    }
}

impl LoadSource for Source {
    fn poll(&self, fallback: bool) -> Poll {
        match self {
            Source::Sglang(s) => s.poll(fallback),
        }
    }

    fn answer(&self, poll: &Poll, status: u32, body: &[u8]) -> Answer {
        match self {
            Source::Sglang(s) => s.answer(poll, status, body),
        }
    }
}
