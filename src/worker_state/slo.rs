//! What SLO admission learns of each rank from the answers that streamed
//! through the gateway (docs/overload.md, "Admission by SLO"): the rank's
//! *first-token margin*, a high expectile of how much longer a first token
//! took than the queue wait predicted when the request was routed; and the
//! worker's *request limit*, a moving quantile over the requests its ranks
//! held: it sinks when an answer misses the time-per-output-token target
//! and rises when one routed near the limit meets it, so that about
//! [`WITHIN_SHARE`] of them meet it. The limit is the worker's, shared
//! evenly by its ranks: they decode in lockstep, so an answer's TPOT
//! follows the whole worker's batch, not its own rank's. Pure: the request
//! lifecycle collects the observations, each thread's tick writes them here.

pub use crate::config::SloTargets;
use serde::{Deserialize, Serialize};

/// The margin's steps toward an observation above it and below it: a
/// moving expectile near the 0.9 one (8 : 1), so a rank that slows is seen
/// in a handful of first tokens, and one good answer moves it little.
pub const MARGIN_UP: f64 = 0.2;
pub const MARGIN_DOWN: f64 = 0.025;
/// The share of answers at the limit the limit is set to keep within the
/// TPOT target: a miss lowers it by `LIMIT_STEP * WITHIN_SHARE` (in log),
/// an answer within the target raises it by `LIMIT_STEP * (1 - WITHIN_SHARE)`.
pub const WITHIN_SHARE: f64 = 0.95;
/// The limit's step: a rank whose every answer misses halves its limit in
/// about 15 answers.
pub const LIMIT_STEP: f64 = 0.05;
/// An answer teaches the limit only if it was routed onto ranks holding
/// from `MISS_COUNTS_FROM` of it (a miss below is not the batch's doing)
/// up to the limit (a miss above it was the doing of a batch the limit
/// already keeps out: it came late, from before the limit last sank); a
/// hit teaches from `NEAR_LIMIT` of it up (below, it says nothing of the
/// limit).
pub const NEAR_LIMIT: f64 = 0.9;
pub const MISS_COUNTS_FROM: f64 = 0.5;
/// What a rank learned is forgotten when its newest observation is this
/// much older than the worker's newest poll (ms): a rank no streamed
/// answer came from lately is judged as if nothing was learned.
pub const FORGET_AFTER_MS: u64 = 30_000;
/// The wait budget is never below this share of the TTFT target, whatever
/// the margin (a workload of prompts too long for its target is still
/// served from short queues).
pub const MIN_WAIT_SHARE: f64 = 0.25;

/// What one routed request's answer showed about its rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observation {
    /// Its first byte came `ttft_ms` after routing, when the queue ahead of
    /// it (its own prompt included) predicted `predicted_wait_ms`.
    FirstToken { ttft_ms: u64, predicted_wait_ms: u64 },
    /// It ended with a mean gap of `tpot_ms` between later chunks; routed
    /// when the worker's ranks held `in_flight` requests (its own
    /// included), if they report them.
    Decoded { tpot_ms: u64, in_flight: Option<u64> },
}

/// One rank's learned figures.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankSlo {
    /// The first-token margin in µs (fine enough that small steps are not
    /// lost to rounding); None before the first observation.
    margin_us: Option<u64>,
    /// The request limit in thousandths; None: none learned (no answer
    /// missed the TPOT target yet).
    limit_milli: Option<u64>,
    /// When the newest observation was applied (ms).
    observed_at_ms: u64,
}

/// What a rank's figures allow now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Learned {
    pub margin_ms: Option<u64>,
    pub request_limit: Option<u64>,
}

impl RankSlo {
    /// Learns from `o`, applied at `now_ms`, against `targets`.
    pub fn observe(&mut self, o: &Observation, targets: &SloTargets, now_ms: u64) {
        self.observed_at_ms = self.observed_at_ms.max(now_ms);
        match *o {
            Observation::FirstToken {
                ttft_ms,
                predicted_wait_ms,
            } => {
                let seen = ttft_ms.saturating_sub(predicted_wait_ms) as f64 * 1000.0;
                let next = match self.margin_us {
                    None => seen,
                    Some(m) => {
                        let m = m as f64;
                        let step = if seen > m { MARGIN_UP } else { MARGIN_DOWN };
                        m + step * (seen - m)
                    }
                };
                self.margin_us = Some(next.round() as u64);
            }
            Observation::Decoded { tpot_ms, in_flight } => {
                let Some(n) = in_flight else { return };
                let n = n as f64 * 1000.0;
                let missed = tpot_ms > targets.tpot_ms;
                let next = match self.limit_milli.map(|l| l as f64) {
                    // The first miss: the limit starts at the requests it came with.
                    None if missed => n,
                    None => return,
                    Some(l) if missed && n >= l * MISS_COUNTS_FROM && n <= l => {
                        l * (-LIMIT_STEP * WITHIN_SHARE).exp()
                    }
                    Some(l) if !missed && n >= l * NEAR_LIMIT => {
                        l * (LIMIT_STEP * (1.0 - WITHIN_SHARE)).exp()
                    }
                    Some(_) => return,
                };
                self.limit_milli = Some(next.max(1000.0).round() as u64);
            }
        }
    }

    /// What the figures allow, for a worker last polled at `polled_at_ms`
    /// (nothing once they are [`FORGET_AFTER_MS`] older).
    pub fn learned(&self, polled_at_ms: u64) -> Learned {
        if polled_at_ms.saturating_sub(self.observed_at_ms) > FORGET_AFTER_MS {
            return Learned::default();
        }
        Learned {
            margin_ms: self.margin_us.map(|m| m / 1000),
            request_limit: self.limit_milli.map(|l| l / 1000),
        }
    }
}

/// The wait budget of a request class whose TTFT target is `ttft_ms` on a
/// rank whose first-token margin is `margin_ms`: the target less the
/// margin, at least [`MIN_WAIT_SHARE`] of it.
pub fn wait_budget_ms(ttft_ms: u64, margin_ms: u64) -> u64 {
    let floor = (ttft_ms as f64 * MIN_WAIT_SHARE) as u64;
    ttft_ms.saturating_sub(margin_ms).max(floor)
}

/// Per rank (the first-token margins) and for the worker (the request
/// limit), as the ticks applied the observations.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SloState {
    ranks: Vec<RankSlo>,
    worker: RankSlo,
}

impl SloState {
    pub fn within_limits(&self, max: usize) -> bool {
        self.ranks.len() <= max
    }

    /// Learns from `o` on rank index `rank` (a first token) or on the
    /// whole worker (a decode).
    pub fn observe(&mut self, rank: usize, o: &Observation, targets: &SloTargets, now_ms: u64) {
        if let Observation::Decoded { .. } = o {
            self.worker.observe(o, targets, now_ms);
            return;
        }
        if rank >= crate::config::MAX_DP_SIZE as usize {
            return;
        }
        if self.ranks.len() <= rank {
            self.ranks.resize(rank + 1, RankSlo::default());
        }
        self.ranks[rank].observe(o, targets, now_ms);
    }

    /// What rank index `rank` of `ranks` allows (see [`RankSlo::learned`]):
    /// its own margin and its even share of the worker's limit.
    pub fn learned(&self, rank: usize, ranks: usize, polled_at_ms: u64) -> Learned {
        let margin_ms = self
            .ranks
            .get(rank)
            .and_then(|r| r.learned(polled_at_ms).margin_ms);
        let request_limit = self
            .worker
            .learned(polled_at_ms)
            .request_limit
            .map(|l| l.div_ceil(ranks.max(1) as u64).max(1));
        Learned {
            margin_ms,
            request_limit,
        }
    }

    /// Forgets ranks past `ranks` (the worker restarted with fewer).
    pub fn keep_ranks(&mut self, ranks: usize) {
        self.ranks.truncate(ranks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TARGETS: SloTargets = SloTargets {
        ttft_ms: 2000,
        tpot_ms: 50,
    };

    fn first(ttft_ms: u64, predicted_wait_ms: u64) -> Observation {
        Observation::FirstToken {
            ttft_ms,
            predicted_wait_ms,
        }
    }

    fn decoded(tpot_ms: u64, in_flight: u64) -> Observation {
        Observation::Decoded {
            tpot_ms,
            in_flight: Some(in_flight),
        }
    }

    #[test]
    fn nothing_is_learned_before_an_observation() {
        let s = SloState::default();
        assert_eq!(s.learned(3, 8, 10_000), Learned::default());
    }

    #[test]
    fn the_margin_rises_fast_toward_slow_first_tokens_and_falls_slowly() {
        let mut r = RankSlo::default();
        r.observe(&first(700, 500), &TARGETS, 1);
        assert_eq!(r.learned(1).margin_ms, Some(200), "the first sets it");
        for _ in 0..15 {
            r.observe(&first(1_700, 500), &TARGETS, 1);
        }
        let high = r.learned(1).margin_ms.unwrap();
        assert!(
            (1_150..=1_200).contains(&high),
            "a straggler is seen within 15 answers: {high}"
        );
        for _ in 0..15 {
            r.observe(&first(700, 500), &TARGETS, 1);
        }
        let after = r.learned(1).margin_ms.unwrap();
        assert!((600..high).contains(&after), "recovering, more slowly: {after}");
        for _ in 0..200 {
            r.observe(&first(700, 500), &TARGETS, 1);
        }
        assert!(r.learned(1).margin_ms.unwrap() <= 205, "and recovered");
    }

    #[test]
    fn the_expectile_sits_high_in_a_spread() {
        let mut r = RankSlo::default();
        // Margins 0, 100, ..., 900 in turn: the mean is 450.
        for i in 0..2_000u64 {
            r.observe(&first(1_000 + (i * 7 % 10) * 100, 1_000), &TARGETS, 1);
        }
        let m = r.learned(1).margin_ms.unwrap();
        assert!((600..=800).contains(&m), "above the mean, below the top: {m}");
    }

    #[test]
    fn the_first_miss_sets_the_limit_and_misses_near_it_lower_it() {
        let mut r = RankSlo::default();
        r.observe(&decoded(40, 30), &TARGETS, 1);
        assert_eq!(r.learned(1).request_limit, None, "within target: no limit");
        r.observe(&decoded(60, 40), &TARGETS, 2);
        assert_eq!(r.learned(2).request_limit, Some(40), "the requests it came with");
        r.observe(&decoded(60, 10), &TARGETS, 3);
        assert_eq!(
            r.learned(3).request_limit,
            Some(40),
            "far below the limit: not the batch"
        );
        r.observe(&decoded(60, 45), &TARGETS, 3);
        assert_eq!(
            r.learned(3).request_limit,
            Some(40),
            "above the limit: routed before it sank, already kept out"
        );
        for _ in 0..15 {
            let at_limit = r.learned(4).request_limit.unwrap();
            r.observe(&decoded(60, at_limit), &TARGETS, 4);
        }
        let halved = r.learned(4).request_limit.unwrap();
        assert!(
            (19..=21).contains(&halved),
            "a straggler halves it in 15 answers: {halved}"
        );
    }

    #[test]
    fn the_limit_settles_where_one_answer_in_twenty_misses() {
        // A rank whose answers miss when it holds more than 30 requests,
        // fed at its limit (plus one): it must settle near 30.
        let mut r = RankSlo::default();
        r.observe(&decoded(60, 50), &TARGETS, 1);
        for i in 0..20_000u64 {
            let limit = r.learned(1).request_limit.unwrap();
            // At the limit, half the answers come from a slightly fuller rank.
            let n = limit + (i % 2);
            let tpot = if n > 30 { 60 } else { 40 };
            r.observe(&decoded(tpot, n), &TARGETS, 1);
        }
        let settled = r.learned(1).request_limit.unwrap();
        assert!(
            (28..=30).contains(&settled),
            "just below where misses start: {settled}"
        );
    }

    #[test]
    fn answers_within_target_raise_it_only_when_the_rank_was_near_it() {
        let mut r = RankSlo::default();
        r.observe(&decoded(60, 20), &TARGETS, 1);
        for _ in 0..100 {
            r.observe(&decoded(40, 5), &TARGETS, 2);
        }
        assert_eq!(
            r.learned(2).request_limit,
            Some(20),
            "not near the limit: it says nothing"
        );
        for _ in 0..200 {
            r.observe(&decoded(40, 20), &TARGETS, 3);
        }
        assert_eq!(
            r.learned(3).request_limit,
            Some(22),
            "raised while the rank held 0.9 of it, no further"
        );
    }

    #[test]
    fn the_limit_never_drops_below_one_and_ranks_without_counts_teach_nothing() {
        let mut r = RankSlo::default();
        for _ in 0..500 {
            r.observe(&decoded(500, 1), &TARGETS, 1);
        }
        assert_eq!(r.learned(1).request_limit, Some(1));
        let mut blind = RankSlo::default();
        blind.observe(
            &Observation::Decoded {
                tpot_ms: 500,
                in_flight: None,
            },
            &TARGETS,
            1,
        );
        assert_eq!(blind.learned(1).request_limit, None);
    }

    #[test]
    fn the_worker_s_limit_is_shared_by_its_ranks_and_forgotten_when_stale() {
        let mut s = SloState::default();
        s.observe(2, &decoded(60, 100), &TARGETS, 1_000);
        s.observe(2, &first(900, 100), &TARGETS, 1_000);
        let learned = s.learned(2, 8, 1_000 + FORGET_AFTER_MS);
        assert_eq!(
            learned,
            Learned {
                margin_ms: Some(800),
                request_limit: Some(13)
            }
        );
        assert_eq!(
            s.learned(0, 8, 1_000).request_limit,
            Some(13),
            "every rank's share of the worker's 100"
        );
        assert_eq!(
            s.learned(0, 8, 1_000).margin_ms,
            None,
            "margins are each rank's own"
        );
        assert_eq!(s.learned(2, 8, 1_001 + FORGET_AFTER_MS), Learned::default());
        s.keep_ranks(2);
        assert_eq!(s.learned(2, 2, 1_000).margin_ms, None);
    }

    #[test]
    fn the_budget_is_the_target_less_the_margin_down_to_a_quarter() {
        assert_eq!(wait_budget_ms(2000, 300), 1700);
        assert_eq!(wait_budget_ms(2000, 1900), 500);
        assert_eq!(wait_budget_ms(2000, 0), 2000);
    }
}
