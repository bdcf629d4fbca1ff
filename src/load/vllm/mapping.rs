//! How vLLM's per-engine figures become dprank's [`RankLoad`]: vLLM reports
//! requests, a share of KV and cumulative prefix-cache counters, not tokens.
//! A rank's tokens are its KV in use (`kv_cache_usage_perc` x its share of
//! `cache_config_info`'s blocks) plus its waiting requests at this gateway's
//! mean request estimate; its cache hit rate is the counters' increase over
//! a window, which needs the last poll's counters ([`CacheCounters`], what
//! the source keeps of a worker in its `SourceMemory`). Why each choice:
//! docs/vllm.md.

use super::{EngineFigures, VllmReport};
use crate::codec::{words, Record};
use crate::config::MAX_DP_SIZE;
use crate::load::{LoadReport, RankLoad, Readout, ReportContext, SourceMemory, HIT_RATE_WINDOW_MS};
use serde::{Deserialize, Serialize};

/// Not read at the last poll.
const UNREAD: u64 = u64::MAX;
/// Words per rank in [`CacheCounters`]: queries and hits as last read, and
/// the windowed sums of their increases.
const WORDS: usize = 4;

/// What the prefix-cache counters need between polls, per rank.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheCounters {
    /// When they were last read (ms since the epoch; 0: never).
    read_at_ms: u64,
    /// Per rank: queries and hits last read (`UNREAD` if not), and the sums
    /// of their increases, decayed over `HIT_RATE_WINDOW_MS`.
    #[serde(with = "words")]
    per_rank: Vec<u64>,
}

/// Kept in the worker's `SourceMemory`.
impl Record for CacheCounters {
    const TAG: [u8; 4] = *b"DPK1";
    fn within_limits(&self) -> bool {
        CacheCounters::within_limits(self, MAX_DP_SIZE as usize)
    }
}

impl CacheCounters {
    /// Whether the sizes are within what dprank ever writes.
    pub fn within_limits(&self, max_ranks: usize) -> bool {
        self.per_rank.len() <= WORDS * max_ranks && self.per_rank.len().is_multiple_of(WORDS)
    }

    /// Takes this poll's counters (`now_ms`) and returns each rank's hit
    /// rate over the window (None while nothing was queried in it). A
    /// counter that went down (the server restarted) starts that rank
    /// afresh; a poll without readable counters adds nothing.
    fn hit_rates(&mut self, engines: &[EngineFigures], now_ms: u64) -> Vec<Option<f64>> {
        let elapsed = match self.read_at_ms {
            0 => 0,
            at => now_ms.saturating_sub(at),
        };
        let keep = (-(elapsed as f64) / HIT_RATE_WINDOW_MS as f64).exp();
        self.read_at_ms = now_ms;
        self.per_rank.resize(WORDS * engines.len(), UNREAD);
        engines
            .iter()
            .zip(self.per_rank.chunks_exact_mut(WORDS))
            .map(|(engine, slot)| {
                let [last_queries, last_hits, queries_sum, hits_sum] = slot else {
                    return None;
                };
                let decayed = |sum: u64| {
                    if sum == UNREAD {
                        0
                    } else {
                        (sum as f64 * keep) as u64
                    }
                };
                let (mut queries, mut hits) = (decayed(*queries_sum), decayed(*hits_sum));
                match (engine.prefix_queries, engine.prefix_hits) {
                    (Some(q), Some(h)) => {
                        if *last_queries == UNREAD {
                            // Nothing to compare with: the window stays as it was.
                        } else if q >= *last_queries && h >= *last_hits && h - *last_hits <= q - *last_queries
                        {
                            queries = queries.saturating_add(q - *last_queries);
                            hits = hits.saturating_add(h - *last_hits);
                        } else {
                            // Counters that went down (a restart), or hits
                            // outgrowing queries: start afresh.
                            (queries, hits) = (0, 0);
                        }
                        (*last_queries, *last_hits) = (q, h);
                    }
                    _ => (*last_queries, *last_hits) = (UNREAD, UNREAD),
                }
                (*queries_sum, *hits_sum) = (queries, hits);
                (queries > 0).then(|| (hits as f64 / queries as f64).clamp(0.0, 1.0))
            })
            .collect()
    }
}

/// A readable `/metrics` answer becomes the report with the counters the
/// worker's memory keeps, updated with this poll's.
impl Readout for VllmReport {
    fn report(&self, memory: &mut SourceMemory, context: &ReportContext) -> LoadReport {
        let mut counters: CacheCounters = memory.read();
        let report = rank_loads(self, &mut counters, context);
        memory.write(&counters);
        report
    }
}

/// The report of a readable `/metrics` answer: per engine, dprank's load
/// figures. `memory` is the worker's, updated with this poll's counters.
pub fn rank_loads(report: &VllmReport, memory: &mut CacheCounters, context: &ReportContext) -> LoadReport {
    let engines = report.engines.len().max(1) as u64;
    // vLLM sums its engines' blocks in `cache_config_info`: an engine's share.
    let capacity = report
        .kv_capacity_tokens
        .map(|total| total / engines)
        .filter(|c| *c > 0);
    let request = context.request_tokens.max(1);
    let rates = memory.hit_rates(&report.engines, context.now_ms);
    let ranks = report
        .engines
        .iter()
        .zip(rates)
        .map(|(engine, hit_rate)| {
            let used = capacity
                .zip(engine.kv_usage)
                .map(|(c, share)| ((c as f64 * share).round() as u64).min(c));
            // Without the KV figures, each running request counts as a mean request.
            let in_use = used.or_else(|| engine.running.map(|r| r.saturating_mul(request)));
            let queued = engine.waiting.map(|w| w.saturating_mul(request));
            RankLoad {
                tokens: in_use.zip(queued).map(|(a, b)| a.saturating_add(b)),
                waiting_requests: engine.waiting,
                running_requests: engine.running,
                waiting_uncached_tokens: queued
                    .map(|q| ((q as f64 * (1.0 - hit_rate.unwrap_or(0.0))).round() as u64).min(q)),
                used_tokens: used,
                capacity_tokens: capacity,
                kv_usage: engine.kv_usage,
                cache_hit_rate: hit_rate,
            }
        })
        .collect();
    LoadReport {
        first_rank: report.first_engine,
        ranks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(running: u64, waiting: u64, kv: f64, queries: u64, hits: u64) -> EngineFigures {
        EngineFigures {
            running: Some(running),
            waiting: Some(waiting),
            kv_usage: Some(kv),
            prefix_queries: Some(queries),
            prefix_hits: Some(hits),
        }
    }

    fn report(engines: Vec<EngineFigures>, capacity: Option<u64>) -> VllmReport {
        VllmReport {
            first_engine: 0,
            engines,
            model_name: "m".into(),
            kv_capacity_tokens: capacity,
            skipped_lines: 0,
        }
    }

    fn context(now_ms: u64, request_tokens: u64) -> ReportContext {
        ReportContext {
            now_ms,
            request_tokens,
        }
    }

    #[test]
    fn tokens_are_kv_in_use_plus_waiting_requests_at_the_mean_estimate() {
        // Two engines sharing 2 x 10000 blocks of 16 tokens: 160000 each.
        let r = report(
            vec![engine(3, 2, 0.25, 0, 0), engine(0, 0, 0.0, 0, 0)],
            Some(20_000 * 16),
        );
        let mut memory = CacheCounters::default();
        let loads = rank_loads(&r, &mut memory, &context(1000, 700));
        assert_eq!(
            loads.ranks[0],
            RankLoad {
                tokens: Some(40_000 + 2 * 700),
                waiting_requests: Some(2),
                running_requests: Some(3),
                waiting_uncached_tokens: Some(1400),
                used_tokens: Some(40_000),
                capacity_tokens: Some(160_000),
                kv_usage: Some(0.25),
                cache_hit_rate: None,
            }
        );
        assert_eq!(loads.ranks[1].tokens, Some(0));
        assert_eq!(loads.ranks[1].capacity_tokens, Some(160_000));
    }

    #[test]
    fn without_the_kv_figures_running_requests_count_as_mean_requests() {
        let mut memory = CacheCounters::default();
        let no_capacity = report(vec![engine(3, 1, 0.5, 0, 0)], None);
        let loads = rank_loads(&no_capacity, &mut memory, &context(1, 100));
        assert_eq!(
            (loads.ranks[0].tokens, loads.ranks[0].used_tokens),
            (Some(400), None)
        );
        let mut no_kv = report(vec![engine(3, 1, 0.0, 0, 0)], Some(1000));
        no_kv.engines[0].kv_usage = None;
        assert_eq!(
            rank_loads(&no_kv, &mut memory, &context(1, 100)).ranks[0].tokens,
            Some(400)
        );
        // No waiting figure, or neither KV nor running: the rank is unknown.
        let mut no_waiting = report(vec![engine(3, 1, 0.5, 0, 0)], Some(1000));
        no_waiting.engines[0].waiting = None;
        let rank = &rank_loads(&no_waiting, &mut memory, &context(1, 100)).ranks[0];
        assert_eq!((rank.tokens, rank.used_tokens), (None, Some(500)));
        let mut blind = report(vec![engine(3, 1, 0.5, 0, 0)], None);
        blind.engines[0].running = None;
        assert_eq!(
            rank_loads(&blind, &mut memory, &context(1, 100)).ranks[0].tokens,
            None
        );
        // A mean estimate of 0 (nothing routed) still counts each request.
        assert_eq!(
            rank_loads(&no_capacity, &mut memory, &context(1, 0)).ranks[0].tokens,
            Some(4)
        );
    }

    #[test]
    fn the_hit_rate_is_the_counters_increase_over_the_window() {
        let mut memory = CacheCounters::default();
        let at = |queries, hits| report(vec![engine(0, 0, 0.0, queries, hits)], None);
        let rate = |memory: &mut CacheCounters, r: &VllmReport, now| {
            rank_loads(r, memory, &context(now, 1)).ranks[0].cache_hit_rate
        };
        assert_eq!(
            rate(&mut memory, &at(10_000, 9_000), 1000),
            None,
            "one read: no increase yet"
        );
        assert_eq!(
            rate(&mut memory, &at(10_000, 9_000), 2000),
            None,
            "nothing queried since"
        );
        assert_eq!(
            rate(&mut memory, &at(11_000, 9_250), 3000),
            Some(0.25),
            "not the lifetime 0.83"
        );
        // Later increases weigh more, older ones fade over the window.
        let r = rate(&mut memory, &at(12_000, 10_250), 3000 + HIT_RATE_WINDOW_MS).unwrap();
        let keep = (-1.0f64).exp();
        let want = (250.0 * keep + 1000.0) / (1000.0 * keep + 1000.0);
        assert!((r - want).abs() < 1e-3, "{r} against {want}");
        // A restart (counters down) starts afresh; so does a rank whose
        // counters were unreadable in between.
        assert_eq!(rate(&mut memory, &at(500, 0), 20_000), None);
        assert_eq!(rate(&mut memory, &at(1500, 1000), 21_000), Some(1.0));
        let mut unread = at(0, 0);
        unread.engines[0].prefix_hits = None;
        assert_eq!(
            rate(&mut memory, &unread, 22_000),
            Some(1.0),
            "the window remains"
        );
        assert_eq!(
            rate(&mut memory, &at(2500, 1000), 23_000),
            Some(1.0),
            "no increase counted across the gap"
        );
        // Hits growing faster than queries are not counters vLLM writes.
        assert_eq!(rate(&mut memory, &at(2600, 1200), 24_000), None);
    }

    #[test]
    fn waiting_requests_are_uncached_by_the_recent_hit_rate() {
        let mut memory = CacheCounters::default();
        let at = |queries, hits| report(vec![engine(0, 4, 0.0, queries, hits)], Some(1000));
        rank_loads(&at(0, 0), &mut memory, &context(1000, 500));
        let rank = &rank_loads(&at(1000, 750), &mut memory, &context(2000, 500)).ranks[0];
        assert_eq!(
            (rank.tokens, rank.waiting_uncached_tokens, rank.cache_hit_rate),
            (Some(2000), Some(500), Some(0.75))
        );
    }

    #[test]
    fn the_readout_keeps_the_counters_in_the_worker_s_memory() {
        let mut memory = SourceMemory::default();
        let at = |queries, hits| report(vec![engine(0, 0, 0.0, queries, hits)], None);
        let rate = |memory: &mut SourceMemory, r: &VllmReport, now| {
            Readout::report(r, memory, &context(now, 1)).ranks[0].cache_hit_rate
        };
        assert_eq!(rate(&mut memory, &at(1000, 500), 1000), None);
        assert_eq!(memory.read::<CacheCounters>().read_at_ms, 1000);
        assert_eq!(rate(&mut memory, &at(2000, 1250), 2000), Some(0.75));
    }

    #[test]
    fn memory_follows_the_engine_count() {
        let mut memory = CacheCounters::default();
        let two = report(vec![engine(0, 0, 0.0, 10, 5), engine(0, 0, 0.0, 10, 5)], None);
        rank_loads(&two, &mut memory, &context(1000, 1));
        assert!(memory.within_limits(2) && !memory.within_limits(1));
        let one = report(vec![engine(0, 0, 0.0, 20, 10)], None);
        let loads = rank_loads(&one, &mut memory, &context(2000, 1));
        assert_eq!(loads.ranks[0].cache_hit_rate, Some(0.5));
        assert!(memory.within_limits(1));
        let three = report(vec![engine(0, 0, 0.0, 30, 18); 3], None);
        let loads = rank_loads(&three, &mut memory, &context(3000, 1));
        let rates: Vec<_> = loads.ranks.iter().map(|r| r.cache_hit_rate).collect();
        assert!(rates[0].is_some_and(|r| r > 0.5 && r < 1.0), "{rates:?}");
        assert_eq!(rates[1..], [None, None], "new engines start afresh");
    }
}
