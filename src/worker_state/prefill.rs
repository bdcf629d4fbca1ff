//! What prefix affinity keeps per worker next to its polled tokens: the
//! prefill queued on each rank (locally and as polled, `prefix_queue`), the
//! figures of the rank's last report that describe it, and how much of the
//! routed prompts the index expected each rank to hold, checked against the
//! hit rate it reports. Buckets follow `WorkerState`'s accounting rule.

use super::UNKNOWN;
use crate::codec::words;
use crate::config::QueueMeasure;
use crate::load::RankLoad;
use serde::{Deserialize, Serialize};

/// Prompt tokens routed to a rank since its last feedback check below which
/// the reported hit rate is not compared (too few admissions to tell). A
/// few long prompts are no evidence: at 8,192 (two prompts of a real
/// trace) chance differences wiped entries the ranks still held
/// (docs/prefix-affinity.md, "Checking the index against the ranks").
pub const FEEDBACK_MIN_TOKENS: u64 = 65_536;
/// The expected hit rate below which a rank is never judged (nothing to lose).
pub const FEEDBACK_MIN_EXPECTED: f64 = 0.2;
/// A rank that reports less than this share of the hit rate the index
/// expected is taken to have lost part of what the index says it holds.
/// Only a large shortfall counts: the index misses the answers a rank also
/// caches and counts prompts when they are routed, not when admitted, so
/// small mismatches are noise (at 0.5 the offline evaluator saw the index
/// shed entries the ranks still held, and fewer cache hits).
pub const FEEDBACK_RATIO: f64 = 0.25;
/// Horizon of the expected-hit counters: SGLang's hit rate covers the
/// admissions of its last 15 s (`SGLANG_CACHE_HIT_RATE_WINDOW_SECONDS`).
pub const FEEDBACK_WINDOW_MS: f64 = 15_000.0;

/// Queued work: uncached prompt tokens, and the requests they belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Queued {
    pub tokens: u64,
    pub requests: u64,
}

impl Queued {
    fn plus(self, o: Queued) -> Queued {
        Queued {
            tokens: self.tokens.saturating_add(o.tokens),
            requests: self.requests.saturating_add(o.requests),
        }
    }
    fn minus(self, o: Queued) -> Queued {
        Queued {
            tokens: self.tokens.saturating_sub(o.tokens),
            requests: self.requests.saturating_sub(o.requests),
        }
    }
    fn max(self, o: Queued) -> Queued {
        Queued {
            tokens: self.tokens.max(o.tokens),
            requests: self.requests.max(o.requests),
        }
    }
}

/// Per rank, a [`Queued`] as two words (tokens, requests).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct PerRank(#[serde(with = "words")] Vec<u64>);

impl PerRank {
    fn get(&self, rank: usize) -> Queued {
        Queued {
            tokens: self.0.get(2 * rank).copied().unwrap_or(0),
            requests: self.0.get(2 * rank + 1).copied().unwrap_or(0),
        }
    }
    fn set(&mut self, rank: usize, q: Queued) {
        if self.0.len() < 2 * rank + 2 {
            self.0.resize(2 * rank + 2, 0);
        }
        if let Some(w) = self.0.get_mut(2 * rank..2 * rank + 2) {
            w.copy_from_slice(&[q.tokens, q.requests]);
        }
    }
    fn add(&mut self, rank: usize, q: Queued) {
        self.set(rank, self.get(rank).plus(q));
    }
    fn sub(&mut self, rank: usize, q: Queued) {
        self.set(rank, self.get(rank).minus(q));
    }
    fn ranks(&self) -> usize {
        self.0.len() / 2
    }
    fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }
}

/// Queued work per rank of requests routed while poll `seq` was the last
/// dispatched one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Bucket {
    seq: u64,
    /// Streamed requests (they leave at their first byte).
    streamed: PerRank,
    /// Non-streamed requests (they leave when a poll covers them).
    other: PerRank,
}

/// The prefill work one routed request adds to its rank, to take back when
/// its first byte comes (or it ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillTicket {
    pub worker: usize,
    pub rank: u32,
    pub seq: u64,
    /// Estimated uncached prompt tokens.
    pub tokens: u64,
    pub streamed: bool,
}

/// What a routed request is expected to cost its rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Charge {
    /// Estimated prompt tokens.
    pub prompt: u64,
    /// Of those, the tokens the index expects the rank to hold.
    pub cached: u64,
}

impl Charge {
    pub fn uncached(&self) -> u64 {
        self.prompt.saturating_sub(self.cached)
    }
}

/// A rank's figures from a load report that prefix affinity uses.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RankFigures {
    pub waiting_uncached: Option<u64>,
    pub waiting_requests: Option<u64>,
    /// `num_running_reqs`.
    pub running_requests: Option<u64>,
    /// KV tokens in use (`num_used_tokens`).
    pub used: Option<u64>,
    pub capacity: Option<u64>,
    /// 0..=1.
    pub cache_hit_rate: Option<f64>,
}

impl From<&RankLoad> for RankFigures {
    fn from(rank: &RankLoad) -> RankFigures {
        RankFigures {
            waiting_uncached: rank.waiting_uncached_tokens,
            waiting_requests: rank.waiting_requests,
            running_requests: rank.running_requests,
            used: rank.used_tokens,
            capacity: rank.capacity_tokens,
            cache_hit_rate: rank.cache_hit_rate,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillState {
    /// Polled `num_waiting_uncached_tokens` and `num_waiting_reqs` per rank
    /// (0 when not reported).
    polled_waiting: PerRank,
    /// Polled `max_total_num_tokens` per rank (0: not reported).
    #[serde(with = "words")]
    capacity: Vec<u64>,
    /// Polled `num_used_tokens` per rank (UNKNOWN: not reported).
    #[serde(with = "words")]
    used: Vec<u64>,
    /// Polled `num_running_reqs` per rank (UNKNOWN: not reported); the one
    /// home of the figure (the lockstep rule and admission read it).
    #[serde(with = "words")]
    running: Vec<u64>,
    /// Polled `cache_hit_rate` per rank in 1/10000 (UNKNOWN: not reported).
    #[serde(with = "words")]
    hit_rate: Vec<u64>,
    /// Requests not yet at their first byte that no snapshot covers yet.
    uncovered: Vec<Bucket>,
    /// Streamed requests a snapshot covers, not yet at their first byte.
    covered: PerRank,
    /// Covered requests that reached their first byte, by the poll last
    /// dispatched then (the snapshots it may still be in).
    drained: Vec<Bucket>,
    /// Prompt tokens routed to each rank, decayed over `FEEDBACK_WINDOW_MS`.
    #[serde(with = "words")]
    sent: Vec<u64>,
    /// Of those, the tokens the index expected each rank to hold.
    #[serde(with = "words")]
    expected: Vec<u64>,
}

fn slot(v: &mut Vec<u64>, rank: usize) -> Option<&mut u64> {
    if v.len() <= rank {
        v.resize(rank + 1, 0);
    }
    v.get_mut(rank)
}

fn at(v: &[u64], rank: usize) -> u64 {
    v.get(rank).copied().unwrap_or(0)
}

/// One request's queued work.
fn one(tokens: u64) -> Queued {
    Queued { tokens, requests: 1 }
}

fn bucket(list: &mut Vec<Bucket>, seq: u64) -> Option<&mut Bucket> {
    let i = match list.iter().position(|b| b.seq == seq) {
        Some(i) => i,
        None => {
            list.push(Bucket {
                seq,
                streamed: PerRank::default(),
                other: PerRank::default(),
            });
            list.len() - 1
        }
    };
    list.get_mut(i)
}

impl PrefillState {
    /// Whether the sizes are within what dprank ever writes.
    pub fn within_limits(&self, max: usize) -> bool {
        let lists = [
            &self.capacity,
            &self.used,
            &self.running,
            &self.hit_rate,
            &self.sent,
            &self.expected,
        ];
        lists.iter().all(|v| v.len() <= max)
            && self.polled_waiting.ranks() <= max
            && self.covered.ranks() <= max
            && self.uncovered.len() <= max
            && self.drained.len() <= max
            && self
                .uncovered
                .iter()
                .chain(&self.drained)
                .all(|b| b.streamed.ranks() <= max && b.other.ranks() <= max)
    }

    /// A routed request's charge to `rank`, while poll `sent_seq` is the
    /// last dispatched.
    pub fn charge(
        &mut self,
        sent_seq: u64,
        worker: usize,
        rank: u32,
        charge: Charge,
        streamed: bool,
    ) -> Option<PrefillTicket> {
        let r = rank as usize;
        let tokens = charge.uncached();
        let b = bucket(&mut self.uncovered, sent_seq)?;
        let list = if streamed { &mut b.streamed } else { &mut b.other };
        list.add(r, one(tokens));
        let s = slot(&mut self.sent, r)?;
        *s = s.saturating_add(charge.prompt);
        let s = slot(&mut self.expected, r)?;
        *s = s.saturating_add(charge.cached);
        Some(PrefillTicket {
            worker,
            rank,
            seq: sent_seq,
            tokens,
            streamed,
        })
    }

    /// The request's prefill is over: its first byte came, or it ended.
    /// `sent_seq` is the last dispatched poll now.
    pub fn started(&mut self, sent_seq: u64, ticket: &PrefillTicket) {
        let r = ticket.rank as usize;
        let q = one(ticket.tokens);
        if let Some(b) = self.uncovered.iter_mut().find(|b| b.seq == ticket.seq) {
            let list = if ticket.streamed {
                &mut b.streamed
            } else {
                &mut b.other
            };
            list.sub(r, q);
            self.uncovered
                .retain(|b| !(b.streamed.is_empty() && b.other.is_empty()));
            return;
        }
        // A non-streamed request left the queue when a poll covered it.
        if !ticket.streamed {
            return;
        }
        self.covered.sub(r, q);
        // The last snapshot may have counted it as waiting: until a poll that
        // leaves after now reports, the polled figure is corrected by it.
        if let Some(b) = bucket(&mut self.drained, sent_seq) {
            b.streamed.add(r, q);
        }
    }

    /// Installs the figures of snapshot `seq` (already accepted by
    /// `WorkerState::apply_snapshot`) and moves what it covers.
    pub fn on_snapshot(&mut self, seq: u64, figures: &[RankFigures]) {
        self.polled_waiting = PerRank::default();
        for (r, f) in figures.iter().enumerate() {
            self.polled_waiting.set(
                r,
                Queued {
                    tokens: f.waiting_uncached.unwrap_or(0),
                    requests: f.waiting_requests.unwrap_or(0),
                },
            );
        }
        self.capacity = figures.iter().map(|f| f.capacity.unwrap_or(0)).collect();
        self.used = figures
            .iter()
            .map(|f| f.used.map_or(UNKNOWN, |u| u.min(UNKNOWN - 1)))
            .collect();
        self.running = figures
            .iter()
            .map(|f| f.running_requests.map_or(UNKNOWN, |r| r.min(UNKNOWN - 1)))
            .collect();
        self.hit_rate = figures
            .iter()
            .map(|f| {
                f.cache_hit_rate
                    .filter(|h| h.is_finite())
                    .map_or(UNKNOWN, |h| (h.clamp(0.0, 1.0) * 10_000.0).round() as u64)
            })
            .collect();
        for b in self.uncovered.iter().filter(|b| b.seq < seq) {
            for r in 0..b.streamed.ranks() {
                self.covered.add(r, b.streamed.get(r));
            }
        }
        self.uncovered.retain(|b| b.seq >= seq);
        self.drained.retain(|b| b.seq >= seq);
    }

    /// The rank's waiting work as its last report gave it (0 when not reported).
    pub fn polled_waiting(&self, rank: usize) -> Queued {
        self.polled_waiting.get(rank)
    }

    /// The rank's reported KV capacity, if its report gave one.
    pub fn capacity(&self, rank: usize) -> Option<u64> {
        self.capacity.get(rank).copied().filter(|c| *c > 0)
    }

    /// The requests the rank last reported running, if its report gave them.
    pub fn running(&self, rank: usize) -> Option<u64> {
        self.running.get(rank).copied().filter(|r| *r != UNKNOWN)
    }

    /// The rank's reported KV tokens in use, if its report gave them.
    pub fn used(&self, rank: usize) -> Option<u64> {
        self.used.get(rank).copied().filter(|u| *u != UNKNOWN)
    }

    /// Work queued on `rank` ahead of a new request, measured as `measure` says.
    pub fn queued(&self, rank: usize, measure: QueueMeasure) -> Queued {
        let uncovered = self
            .uncovered
            .iter()
            .map(|b| b.streamed.get(rank).plus(b.other.get(rank)))
            .fold(Queued::default(), Queued::plus);
        let local = || self.covered.get(rank).plus(uncovered);
        let polled = || {
            let drained = self
                .drained
                .iter()
                .map(|b| b.streamed.get(rank))
                .fold(Queued::default(), Queued::plus);
            self.polled_waiting.get(rank).plus(uncovered).minus(drained)
        };
        match measure {
            QueueMeasure::Local => local(),
            QueueMeasure::Polled => polled(),
            QueueMeasure::Max => local().max(polled()),
        }
    }

    /// This gateway's requests on `rank` routed since the last poll left
    /// (what no snapshot has counted yet).
    pub fn since_poll(&self, rank: usize) -> Queued {
        self.uncovered
            .iter()
            .map(|b| b.streamed.get(rank).plus(b.other.get(rank)))
            .fold(Queued::default(), Queued::plus)
    }

    /// Checks each rank's reported hit rate against what the index
    /// expected of the prompts routed there, then ages the counters by
    /// `elapsed_ms`. Returns, per rank that reported much less than
    /// expected, the share of its index to keep (reported / expected).
    pub fn cache_feedback(&mut self, elapsed_ms: u64) -> Vec<(usize, f64)> {
        let mut shrink = Vec::new();
        for (rank, reported) in self.hit_rate.iter().enumerate() {
            let (sent, expected) = (at(&self.sent, rank), at(&self.expected, rank));
            if *reported == UNKNOWN || sent < FEEDBACK_MIN_TOKENS {
                continue;
            }
            let expected_rate = expected as f64 / sent as f64;
            let reported = *reported as f64 / 10_000.0;
            if expected_rate >= FEEDBACK_MIN_EXPECTED && reported < expected_rate * FEEDBACK_RATIO {
                shrink.push((rank, (reported / expected_rate).clamp(0.0, 1.0)));
                // Judge the index as it is now from fresh evidence only.
                if let (Some(s), Some(e)) = (self.sent.get_mut(rank), self.expected.get_mut(rank)) {
                    (*s, *e) = (0, 0);
                }
            }
        }
        let keep = (-(elapsed_ms as f64) / FEEDBACK_WINDOW_MS).exp();
        for v in self.sent.iter_mut().chain(self.expected.iter_mut()) {
            *v = (*v as f64 * keep) as u64;
        }
        shrink
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_requests_as_reported() {
        let mut p = PrefillState::default();
        assert_eq!(p.running(0), None, "before any report");
        let reported = RankFigures {
            running_requests: Some(40),
            ..Default::default()
        };
        p.on_snapshot(1, &[reported, RankFigures::default()]);
        assert_eq!(p.running(0), Some(40));
        assert_eq!(p.running(1), None, "not reported");
    }

    fn figures(waiting: &[u64]) -> Vec<RankFigures> {
        waiting
            .iter()
            .map(|w| RankFigures {
                waiting_uncached: Some(*w),
                waiting_requests: Some(1),
                running_requests: Some(2),
                used: Some(100),
                capacity: Some(1000),
                cache_hit_rate: Some(0.5),
            })
            .collect()
    }

    fn charge(uncached: u64) -> Charge {
        Charge {
            prompt: uncached + 10,
            cached: 10,
        }
    }

    #[test]
    fn local_queue_holds_streamed_requests_until_their_first_byte() {
        let mut p = PrefillState::default();
        let t = p.charge(1, 0, 1, charge(100), true).unwrap();
        assert_eq!(t.tokens, 100);
        assert_eq!(p.queued(1, QueueMeasure::Local).tokens, 100);
        p.on_snapshot(2, &figures(&[0, 0]));
        assert_eq!(
            p.queued(1, QueueMeasure::Local).tokens,
            100,
            "covered, still waiting"
        );
        p.started(2, &t);
        assert_eq!(p.queued(1, QueueMeasure::Local).tokens, 0);
        assert_eq!(p.queued(0, QueueMeasure::Local).tokens, 0);
    }

    #[test]
    fn non_streamed_requests_leave_the_local_queue_when_a_poll_covers_them() {
        let mut p = PrefillState::default();
        let t = p.charge(1, 0, 0, charge(50), false).unwrap();
        p.on_snapshot(1, &figures(&[0]));
        assert_eq!(
            p.queued(0, QueueMeasure::Local).tokens,
            50,
            "this poll left before it"
        );
        p.on_snapshot(2, &figures(&[50]));
        assert_eq!(p.queued(0, QueueMeasure::Local).tokens, 0);
        assert_eq!(
            p.queued(0, QueueMeasure::Polled).tokens,
            50,
            "the server counts it now"
        );
        p.started(2, &t);
        assert_eq!(
            p.queued(0, QueueMeasure::Polled).tokens,
            50,
            "no first byte to learn from"
        );
    }

    #[test]
    fn polled_queue_adds_uncovered_requests_and_subtracts_drained_ones() {
        let mut p = PrefillState::default();
        p.on_snapshot(1, &figures(&[300]));
        let early = p.charge(1, 0, 0, charge(40), true).unwrap();
        assert_eq!(p.queued(0, QueueMeasure::Polled).tokens, 340);
        // Poll 2 leaves after it and counts it: 300 from others + 40.
        p.on_snapshot(2, &figures(&[340]));
        assert_eq!(p.queued(0, QueueMeasure::Polled).tokens, 340, "not counted twice");
        p.started(2, &early);
        assert_eq!(
            p.queued(0, QueueMeasure::Polled).tokens,
            300,
            "started since the snapshot"
        );
        assert_eq!(p.queued(0, QueueMeasure::Local).tokens, 0);
        // Poll 3 left after the first byte: its figure no longer has it.
        p.on_snapshot(3, &figures(&[300]));
        assert_eq!(p.queued(0, QueueMeasure::Polled).tokens, 300);
        assert_eq!(p.queued(0, QueueMeasure::Max).tokens, 300);
        let late = p.charge(3, 0, 0, charge(500), true).unwrap();
        assert_eq!(p.queued(0, QueueMeasure::Max).tokens, 800);
        let both = p.queued(0, QueueMeasure::Polled);
        assert_eq!(both.requests, 1 + 1, "the polled waiting request and the new one");
        assert_eq!(p.queued(0, QueueMeasure::Local).requests, 1);
        p.started(3, &late);
        assert_eq!(p.queued(0, QueueMeasure::Max).tokens, 300);
        assert!(p.uncovered.is_empty() && p.drained.is_empty());
    }

    #[test]
    fn unknown_polled_figures_count_as_nothing() {
        let mut p = PrefillState::default();
        p.on_snapshot(1, &[RankFigures::default()]);
        p.charge(1, 0, 0, charge(7), true).unwrap();
        assert_eq!(p.queued(0, QueueMeasure::Polled).tokens, 7);
        assert_eq!(p.capacity(0), None);
        assert_eq!(p.queued(5, QueueMeasure::Max).tokens, 0, "a rank never seen");
    }

    #[test]
    fn a_rank_reporting_far_fewer_hits_than_expected_loses_part_of_its_index() {
        let mut p = PrefillState::default();
        let hits = |rate: f64| {
            vec![
                RankFigures {
                    cache_hit_rate: Some(rate),
                    ..Default::default()
                },
                RankFigures {
                    cache_hit_rate: Some(0.0),
                    ..Default::default()
                },
            ]
        };
        // Rank 0: 80% expected; rank 1: nothing expected, nothing judged.
        for _ in 0..100 {
            p.charge(
                1,
                0,
                0,
                Charge {
                    prompt: 1000,
                    cached: 800,
                },
                true,
            );
            p.charge(
                1,
                0,
                1,
                Charge {
                    prompt: 1000,
                    cached: 0,
                },
                true,
            );
        }
        p.on_snapshot(1, &hits(0.7));
        assert!(p.cache_feedback(1000).is_empty(), "close enough to expected");
        p.on_snapshot(2, &hits(0.3));
        assert!(p.cache_feedback(1000).is_empty(), "a shortfall, not a loss");
        p.on_snapshot(3, &hits(0.1));
        let shrink = p.cache_feedback(1000);
        assert_eq!(shrink.len(), 1);
        assert_eq!(shrink[0].0, 0);
        assert!((shrink[0].1 - 0.125).abs() < 1e-3, "{shrink:?}");
        assert!(p.cache_feedback(1000).is_empty(), "fresh evidence needed first");
        p.charge(
            1,
            0,
            0,
            Charge {
                prompt: 100,
                cached: 100,
            },
            true,
        );
        assert!(p.cache_feedback(1000).is_empty(), "too few tokens to judge");
    }

    #[test]
    fn a_few_long_prompts_are_no_evidence_of_a_lost_cache() {
        // Four prompts of 8,000 tokens, 80% expected in cache, 5% reported:
        // one rank's chance, not a lost cache (the old 8,192-token floor
        // judged it and wiped entries the rank still held).
        let mut p = PrefillState::default();
        for _ in 0..4 {
            p.charge(
                1,
                0,
                0,
                Charge {
                    prompt: 8000,
                    cached: 6400,
                },
                true,
            );
        }
        p.on_snapshot(
            1,
            &[RankFigures {
                cache_hit_rate: Some(0.05),
                ..Default::default()
            }],
        );
        assert!(p.cache_feedback(1000).is_empty());
    }
}
