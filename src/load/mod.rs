//! Load sources: what a worker's engine is asked for its load, and how its
//! answer is read into one [`LoadReport`]. The poller asks the source what
//! to request and hands it the answer; it knows no engine, and the types
//! here know no engine's shapes: an engine's answers ([`Readout`]) and what
//! it keeps of a worker between polls ([`Remembered`], stored opaque as the
//! worker's [`SourceMemory`]) are its own types, in its own module. Two engines:
//! SGLang (`sglang.rs`) and vLLM (`vllm.rs`, its figures mapped in
//! `vllm/mapping.rs`); another is a module beside them and one line in
//! [`Source::of`] (docs/architecture.md).

pub mod prometheus;
pub mod sglang;
pub mod vllm;

use crate::codec::{self, Record};
use crate::config::{Config, Engine, MAX_DP_SIZE};
use serde::{Deserialize, Serialize};
use std::any::Any;
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
#[derive(Debug, PartialEq)]
pub enum Answer {
    Report(Reading),
    /// The endpoint does not exist on this worker: poll it again at once on
    /// the source's fallback, and from now on ([`LoadSource::fall_back`]).
    FallBack,
    /// A report whose ranks cannot be trusted: not applied, logged once.
    Refused(String),
    /// Nothing usable (an HTTP error, a body that is not a report).
    Failed(String),
}

/// What a source read from an answer, in its own type: turned into the
/// report inside the write that applies it, with the worker's memory and
/// this gateway's estimates.
pub trait Readout: fmt::Debug + PartialEq + 'static {
    /// The report, per rank; `memory` (the worker's) learns this poll.
    fn report(&self, memory: &mut SourceMemory, context: &ReportContext) -> LoadReport;
}

/// A report complete in itself (SGLang's, in tokens).
impl Readout for LoadReport {
    fn report(&self, _memory: &mut SourceMemory, _context: &ReportContext) -> LoadReport {
        self.clone()
    }
}

/// A [`Readout`] of any source's type, as [`Reading`] holds it.
trait AnyReadout: fmt::Debug {
    fn report(&self, memory: &mut SourceMemory, context: &ReportContext) -> LoadReport;
    fn as_any(&self) -> &dyn Any;
    fn same(&self, other: &dyn AnyReadout) -> bool;
}

impl<R: Readout> AnyReadout for R {
    fn report(&self, memory: &mut SourceMemory, context: &ReportContext) -> LoadReport {
        Readout::report(self, memory, context)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn same(&self, other: &dyn AnyReadout) -> bool {
        other.as_any().downcast_ref::<R>() == Some(self)
    }
}

/// A readable answer, before what needs the worker's memory and this
/// gateway's estimates is worked out ([`Reading::report`]): the source's
/// [`Readout`], opaque here (one allocation per poll).
#[derive(Debug)]
pub struct Reading(Box<dyn AnyReadout>);

impl PartialEq for Reading {
    fn eq(&self, other: &Reading) -> bool {
        self.0.same(other.0.as_ref())
    }
}

impl Reading {
    pub fn new(readout: impl Readout) -> Reading {
        Reading(Box::new(readout))
    }

    /// The report, per rank; `memory` (the worker's) learns this poll.
    pub fn report(&self, memory: &mut SourceMemory, context: &ReportContext) -> LoadReport {
        self.0.report(memory, context)
    }

    /// The source's readout, if it is an `R`.
    pub fn readout<R: Readout>(&self) -> Option<&R> {
        self.0.as_any().downcast_ref()
    }
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

/// What a source keeps of a worker between polls, in its own type: a
/// shared-data [`Record`] (its own tag, and `within_limits` against
/// `MAX_DP_SIZE` ranks), `Default` for nothing kept.
pub trait Remembered: Record + Default + PartialEq {}

impl<M: Record + Default + PartialEq> Remembered for M {}

/// Bytes a source may keep of a worker: 64 a rank, and 64 more.
pub const fn max_memory_bytes(max_ranks: usize) -> usize {
    64 * max_ranks + 64
}

/// What the worker's load source keeps of it between polls, in the worker's
/// state (so whichever thread polls next knows): the source's
/// [`Remembered`] type, encoded (its tag, then postcard); empty when it
/// keeps nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceMemory(#[serde(with = "crate::codec::bytes")] Vec<u8>);

impl SourceMemory {
    /// What was kept, as an `M`; `M::default()` when nothing was, or
    /// something else was (another source's, or beyond its limits).
    pub fn read<M: Remembered>(&self) -> M {
        match self.0.is_empty() {
            true => M::default(),
            false => codec::decode(&self.0).unwrap_or_default(),
        }
    }

    /// Keeps `memory`: nothing for `M::default()`, and nothing (the source
    /// starts afresh) for more than [`max_memory_bytes`] allows.
    pub fn write<M: Remembered>(&mut self, memory: &M) {
        self.0.clear();
        if *memory != M::default() {
            let bytes = codec::encode(memory);
            if bytes.len() <= max_memory_bytes(MAX_DP_SIZE as usize) {
                self.0 = bytes;
            }
        }
    }

    /// Whether the size is within what dprank ever writes.
    pub fn within_limits(&self, max_ranks: usize) -> bool {
        self.0.len() <= max_memory_bytes(max_ranks)
    }
}

/// An engine's load endpoint.
pub trait LoadSource {
    /// The poll of a worker, given what the source remembers of it.
    fn poll(&self, memory: &SourceMemory) -> Poll;
    /// What the worker's answer to `poll` (HTTP `status`, `body`) means.
    fn answer(&self, poll: &Poll, status: u32, body: &[u8]) -> Answer;
    /// After [`Answer::FallBack`]: `memory` (the worker's) learns to poll the
    /// fallback from now on; the poll it now sends. A source without a
    /// fallback never answers so.
    fn fall_back(&self, memory: &mut SourceMemory) -> Poll {
        self.poll(memory)
    }
}

/// The load source of a configuration.
pub struct Source<'c>(Box<dyn LoadSource + 'c>);

impl Source<'_> {
    /// The registry: the source of each `engine`.
    pub fn of(config: &Config) -> Source<'_> {
        Source(match &config.engine {
            Engine::Sglang => Box::new(sglang::Sglang::of(config)),
            Engine::Vllm { .. } => Box::new(vllm::Vllm::of(config)),
        })
    }
}

impl LoadSource for Source<'_> {
    fn poll(&self, memory: &SourceMemory) -> Poll {
        self.0.poll(memory)
    }

    fn answer(&self, poll: &Poll, status: u32, body: &[u8]) -> Answer {
        self.0.answer(poll, status, body)
    }

    fn fall_back(&self, memory: &mut SourceMemory) -> Poll {
        self.0.fall_back(memory)
    }
}

#[cfg(test)]
mod tests {
    use super::sglang::FellBack;
    use super::vllm::mapping::CacheCounters;
    use super::*;

    #[test]
    fn a_source_reads_back_only_its_own_memory() {
        let mut memory = SourceMemory::default();
        assert_eq!(memory.read::<FellBack>(), FellBack(false), "nothing kept");
        memory.write(&FellBack(true));
        assert_eq!(memory.read::<FellBack>(), FellBack(true));
        assert_eq!(
            memory.read::<CacheCounters>(),
            CacheCounters::default(),
            "another source's memory: nothing"
        );
        memory.write(&FellBack(false));
        assert_eq!(memory, SourceMemory::default(), "the default keeps no bytes");
    }

    /// A memory as large as a source may keep of a worker of `MAX_DP_SIZE`
    /// ranks, and one larger.
    #[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
    struct Blob(#[serde(with = "crate::codec::bytes")] Vec<u8>);

    impl Record for Blob {
        const TAG: [u8; 4] = *b"DPT1";
    }

    #[test]
    fn a_memory_beyond_the_limit_is_not_kept() {
        let max = max_memory_bytes(MAX_DP_SIZE as usize);
        // The tag and a 3-byte length come before the bytes.
        let largest = Blob(vec![1; max - 7]);
        let mut memory = SourceMemory::default();
        memory.write(&largest);
        assert_eq!(memory.read::<Blob>(), largest);
        assert!(memory.within_limits(MAX_DP_SIZE as usize));
        memory.write(&Blob(vec![1; max - 6]));
        assert_eq!(memory, SourceMemory::default(), "forgotten: start afresh");
    }

    #[test]
    fn readings_compare_by_their_source_s_readout() {
        let report = |tokens| LoadReport {
            first_rank: 0,
            ranks: vec![RankLoad {
                tokens: Some(tokens),
                ..RankLoad::default()
            }],
        };
        assert_eq!(Reading::new(report(1)), Reading::new(report(1)));
        assert_ne!(Reading::new(report(1)), Reading::new(report(2)));
        let vllm = vllm::VllmReport {
            first_engine: 0,
            engines: Vec::new(),
            model_name: "m".into(),
            kv_capacity_tokens: None,
            skipped_lines: 0,
        };
        assert_ne!(Reading::new(report(1)), Reading::new(vllm.clone()));
        assert_eq!(Reading::new(vllm.clone()).readout(), Some(&vllm));
        assert_eq!(Reading::new(report(1)).readout::<vllm::VllmReport>(), None);
        let context = ReportContext {
            now_ms: 1,
            request_tokens: 1,
        };
        let mut memory = SourceMemory::default();
        assert_eq!(Reading::new(report(3)).report(&mut memory, &context), report(3));
        assert_eq!(memory, SourceMemory::default(), "a complete report keeps nothing");
    }
}
