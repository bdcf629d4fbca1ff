//! What SLO admission learns from the answers that streamed through the
//! gateway (docs/overload.md, "Admission by SLO"): each rank's
//! *first-token margin*, a high expectile of how much longer a first token
//! took than the queue wait predicted when the request was routed; and the
//! worker's *request limit*, read off how often its answers missed the
//! time-per-output-token target against how many requests its ranks held
//! when they were routed (a histogram of misses by batch): the smallest
//! batch whose answers miss clearly more often than the best batches do.
//! Where small batches miss as often as large ones (long prompts stalling
//! the lockstep decode), no limit would cure it, and none is set. The
//! limit is the worker's, shared evenly by its ranks: they decode in
//! lockstep, so an answer's TPOT follows the whole worker's batch. Pure:
//! the request lifecycle collects the observations, each thread's tick
//! writes them here.

pub use crate::config::SloTargets;
use serde::{Deserialize, Serialize};

/// The margin's steps toward an observation above it and below it: a
/// moving expectile near the 0.9 one (8 : 1), so a rank that slows is seen
/// in a handful of first tokens, and one good answer moves it little.
pub const MARGIN_UP: f64 = 0.2;
pub const MARGIN_DOWN: f64 = 0.025;
/// What was learned is forgotten when the newest observation is this much
/// older than the worker's newest poll (ms): a worker no streamed answer
/// came from lately is judged as if nothing was learned.
pub const FORGET_AFTER_MS: u64 = 30_000;
/// The wait budget is never below this share of the TTFT target, whatever
/// the margin (a workload of prompts too long for its target is still
/// served from short queues).
pub const MIN_WAIT_SHARE: f64 = 0.25;
/// Batches are counted in bins whose edges grow by this ratio (1, 2, 3, 4,
/// 5, 6, 7, 8, 9, 10, 12, 14, ...): the limit's resolution.
pub const BIN_RATIO: f64 = 1.15;
/// Bins kept: batches of up to about 1.15^64 (7,700) requests per worker.
pub const BINS: usize = 64;
/// A bin's figures follow about the last this many answers of the worker
/// (every answer fades every bin): bins the limit keeps empty fade, and
/// the limit is tried again above them after a few minutes of traffic.
pub const BIN_SPAN: f64 = 5_000.0;
/// A bin judges only with at least this many (faded) answers in it, and
/// against at least `BELOW_EVIDENCE` answers of smaller batches.
pub const BIN_EVIDENCE: f64 = 20.0;
pub const BELOW_EVIDENCE: f64 = 100.0;
/// The most the limit rises per answer (0.1%: doubling over about 700
/// answers).
pub const LIMIT_RISE: f64 = 1.001;
/// A bin is past the limit when its answers miss this much more often
/// than all those of smaller batches, and by more than `MISS_Z` standard
/// errors of that rate (not by chance).
pub const MISS_EXCESS: f64 = 0.05;
pub const MISS_Z: f64 = 4.0;
/// A bin whose answers miss more often than this is past the limit
/// whatever smaller batches did (a fleet that was overrun before any
/// smaller batch was judged).
pub const MISS_CEILING: f64 = 0.5;

/// What one routed request's answer showed.
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

/// One rank's first-token margin.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct RankMargin {
    /// In µs (fine enough that small steps are not lost to rounding).
    margin_us: u64,
    /// When the newest observation was applied (ms).
    observed_at_ms: u64,
}

impl RankMargin {
    fn observe(&mut self, ttft_ms: u64, predicted_wait_ms: u64, now_ms: u64) {
        let seen = ttft_ms.saturating_sub(predicted_wait_ms) as f64 * 1000.0;
        let next = match self.observed_at_ms {
            0 => seen,
            _ => {
                let m = self.margin_us as f64;
                let step = if seen > m { MARGIN_UP } else { MARGIN_DOWN };
                m + step * (seen - m)
            }
        };
        self.margin_us = next.round() as u64;
        self.observed_at_ms = now_ms.max(1);
    }
}

/// Answers and misses of one bin of batches, faded (in thousandths).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Bin {
    answers_milli: u64,
    misses_milli: u64,
}

impl Bin {
    fn answers(&self) -> f64 {
        self.answers_milli as f64 / 1000.0
    }

    fn miss_rate(&self) -> f64 {
        self.misses_milli as f64 / self.answers_milli.max(1) as f64
    }
}

/// Bins 0..=9 hold batches of 1 to 10 requests one by one; above, each
/// bin's edges grow by [`BIN_RATIO`].
const ONE_BY_ONE: usize = 10;

/// The bin of a batch of `n` requests.
fn bin_of(n: u64) -> usize {
    if n as usize <= ONE_BY_ONE {
        return (n as usize).saturating_sub(1);
    }
    let above = ((n as f64 / ONE_BY_ONE as f64).ln() / BIN_RATIO.ln() + 1e-9).floor() as usize;
    (ONE_BY_ONE + above).min(BINS - 1)
}

/// The smallest batch in bin `b`.
fn bin_floor(b: usize) -> u64 {
    if b < ONE_BY_ONE {
        return b as u64 + 1;
    }
    let mut n = (ONE_BY_ONE as f64 * BIN_RATIO.powi((b - ONE_BY_ONE) as i32)).floor() as u64;
    while bin_of(n) < b {
        n += 1;
    }
    while n > 1 && bin_of(n - 1) >= b {
        n -= 1;
    }
    n
}

/// The worker's misses by batch, and the limit they give.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct WorkerMisses {
    bins: Vec<Bin>,
    observed_at_ms: u64,
    /// The limit in thousandths: down at once to what
    /// [`WorkerMisses::judge`] finds, up by at most [`LIMIT_RISE`] per
    /// answer (toward a higher bin, or with none judged: the answers that
    /// tell of a larger batch come only after its long decodes).
    limit_milli: Option<u64>,
}

impl WorkerMisses {
    fn observe(&mut self, missed: bool, n: u64, now_ms: u64) {
        if self.bins.len() < BINS {
            self.bins.resize(BINS, Bin::default());
        }
        let keep = 1.0 - 1.0 / BIN_SPAN;
        for bin in &mut self.bins {
            bin.answers_milli = (bin.answers_milli as f64 * keep) as u64;
            bin.misses_milli = (bin.misses_milli as f64 * keep) as u64;
        }
        let bin = &mut self.bins[bin_of(n)];
        bin.answers_milli += 1000;
        bin.misses_milli += if missed { 1000 } else { 0 };
        self.observed_at_ms = now_ms.max(1);
        let judged = self.judge().map(|n| n.saturating_mul(1000));
        let risen = self.limit_milli.map(|l| (l as f64 * LIMIT_RISE).ceil() as u64);
        self.limit_milli = match (judged, risen) {
            (Some(j), Some(r)) => Some(j.min(r)),
            (j, r) => j.or(r),
        };
    }

    /// The smallest batch of the first bin (from the smallest batches up)
    /// whose answers miss more often than all the answers of smaller
    /// batches, by [`MISS_EXCESS`] and beyond chance ([`MISS_Z`] standard
    /// errors of the difference), or more often than [`MISS_CEILING`];
    /// None: no batch misses clearly more than smaller ones.
    fn judge(&self) -> Option<u64> {
        let (mut answers, mut misses) = (0.0, 0.0);
        for (i, bin) in self.bins.iter().enumerate() {
            let n = bin.answers();
            if n >= BIN_EVIDENCE && bin.miss_rate() > MISS_CEILING {
                return Some(bin_floor(i));
            }
            if n >= BIN_EVIDENCE && answers >= BELOW_EVIDENCE {
                let below = misses / answers;
                let pooled = (misses + bin.misses_milli as f64 / 1000.0) / (answers + n);
                let spread = (pooled * (1.0 - pooled) * (1.0 / n + 1.0 / answers))
                    .sqrt()
                    .max(1.0 / n);
                let excess = bin.miss_rate() - below;
                if excess > MISS_EXCESS && excess > MISS_Z * spread {
                    return Some(bin_floor(i));
                }
            }
            answers += n;
            misses += bin.misses_milli as f64 / 1000.0;
        }
        None
    }
}

/// What a rank's figures allow now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Learned {
    pub margin_ms: Option<u64>,
    pub request_limit: Option<u64>,
}

/// The wait budget of a request class whose TTFT target is `ttft_ms` on a
/// rank whose first-token margin is `margin_ms`: the target less the
/// margin, at least [`MIN_WAIT_SHARE`] of it.
pub fn wait_budget_ms(ttft_ms: u64, margin_ms: u64) -> u64 {
    let floor = (ttft_ms as f64 * MIN_WAIT_SHARE) as u64;
    ttft_ms.saturating_sub(margin_ms).max(floor)
}

/// Per rank (the first-token margins) and for the worker (its misses by
/// batch), as the ticks applied the observations.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SloState {
    ranks: Vec<RankMargin>,
    worker: WorkerMisses,
}

impl SloState {
    pub fn within_limits(&self, max: usize) -> bool {
        self.ranks.len() <= max && self.worker.bins.len() <= BINS
    }

    /// Learns from `o`, on rank index `rank` (a first token) or on the
    /// whole worker (a decode), applied at `now_ms`, against `targets`.
    pub fn observe(&mut self, rank: usize, o: &Observation, targets: &SloTargets, now_ms: u64) {
        match *o {
            Observation::FirstToken {
                ttft_ms,
                predicted_wait_ms,
            } => {
                if rank >= crate::config::MAX_DP_SIZE as usize {
                    return;
                }
                if self.ranks.len() <= rank {
                    self.ranks.resize(rank + 1, RankMargin::default());
                }
                self.ranks[rank].observe(ttft_ms, predicted_wait_ms, now_ms);
            }
            Observation::Decoded { tpot_ms, in_flight } => {
                if let Some(n) = in_flight {
                    self.worker.observe(tpot_ms > targets.tpot_ms, n, now_ms);
                }
            }
        }
    }

    /// What rank index `rank` of `ranks` allows, for a worker last polled
    /// at `polled_at_ms`: its own margin and its even share of the
    /// worker's limit, each as long as it was confirmed within
    /// [`FORGET_AFTER_MS`].
    pub fn learned(&self, rank: usize, ranks: usize, polled_at_ms: u64) -> Learned {
        let fresh = |at: u64| at > 0 && polled_at_ms.saturating_sub(at) <= FORGET_AFTER_MS;
        let margin_ms = self
            .ranks
            .get(rank)
            .filter(|r| fresh(r.observed_at_ms))
            .map(|r| r.margin_us / 1000);
        let request_limit = fresh(self.worker.observed_at_ms)
            .then_some(self.worker.limit_milli)
            .flatten()
            .map(|l| l / 1000)
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

    fn margin(s: &SloState) -> Option<u64> {
        s.learned(0, 1, 1).margin_ms
    }

    #[test]
    fn nothing_is_learned_before_an_observation() {
        let s = SloState::default();
        assert_eq!(s.learned(3, 8, 10_000), Learned::default());
    }

    #[test]
    fn bins_hold_small_batches_one_by_one_and_larger_ones_by_the_ratio() {
        assert_eq!(
            (bin_of(0), bin_of(1), bin_of(2), bin_of(10), bin_of(11)),
            (0, 0, 1, 9, 10)
        );
        assert!(bin_of(100) > bin_of(80) && bin_of(100) < bin_of(130));
        assert_eq!(bin_of(u64::MAX), BINS - 1);
        for b in 0..BINS {
            let floor = bin_floor(b);
            assert_eq!(bin_of(floor), b, "bin {b} starts at {floor}");
            assert!(floor == 1 || bin_of(floor - 1) < b);
        }
    }

    #[test]
    fn the_margin_rises_fast_toward_slow_first_tokens_and_falls_slowly() {
        let mut s = SloState::default();
        s.observe(0, &first(700, 500), &TARGETS, 1);
        assert_eq!(margin(&s), Some(200), "the first sets it");
        for _ in 0..15 {
            s.observe(0, &first(1_700, 500), &TARGETS, 1);
        }
        let high = margin(&s).unwrap();
        assert!(
            (1_150..=1_200).contains(&high),
            "a straggler is seen within 15 answers: {high}"
        );
        for _ in 0..15 {
            s.observe(0, &first(700, 500), &TARGETS, 1);
        }
        let after = margin(&s).unwrap();
        assert!((600..high).contains(&after), "recovering, more slowly: {after}");
        for _ in 0..200 {
            s.observe(0, &first(700, 500), &TARGETS, 1);
        }
        assert!(margin(&s).unwrap() <= 205, "and recovered");
    }

    #[test]
    fn the_expectile_sits_high_in_a_spread() {
        let mut s = SloState::default();
        // Margins 0, 100, ..., 900 in turn: the mean is 450.
        for i in 0..2_000u64 {
            s.observe(0, &first(1_000 + (i * 7 % 10) * 100, 1_000), &TARGETS, 1);
        }
        let m = margin(&s).unwrap();
        assert!((600..=800).contains(&m), "above the mean, below the top: {m}");
    }

    /// A worker of 8 ranks fed `answers` answers at batches spread from 8
    /// to 800, of which those routed at `miss_from` requests or more
    /// miss, and one in `base` of the others.
    fn fed(miss_from: u64, base: u64, answers: u64) -> SloState {
        let mut s = SloState::default();
        let mut x = 7u64;
        for _ in 0..answers {
            let mut next = || {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                x >> 33
            };
            let n = 8 + next() % 793;
            let missed = n >= miss_from || next() % base == 0;
            s.observe(0, &decoded(if missed { 60 } else { 40 }, n), &TARGETS, 1);
        }
        s
    }

    #[test]
    fn the_limit_is_where_larger_batches_start_to_miss() {
        let s = fed(400, 25, 20_000);
        let limit = s.learned(0, 8, 1).request_limit.unwrap() * 8;
        assert!(
            (352..=416).contains(&limit),
            "the worker's {limit}, each rank an eighth"
        );
    }

    #[test]
    fn no_limit_where_small_batches_miss_as_often_as_large_ones() {
        let s = fed(u64::MAX, 6, 20_000);
        assert_eq!(
            s.learned(0, 8, 1).request_limit,
            None,
            "one in six misses at every batch"
        );
    }

    #[test]
    fn an_overrun_worker_is_limited_where_most_answers_miss() {
        let mut s = SloState::default();
        for i in 0..200u64 {
            // Only large batches were ever answered, most of them late.
            let n = 600 + i % 200;
            s.observe(0, &decoded(if i % 4 == 0 { 40 } else { 60 }, n), &TARGETS, 1);
        }
        let limit = s.learned(0, 8, 1).request_limit.unwrap() * 8;
        assert!(
            (500..=700).contains(&limit),
            "the floor of the bin of 600: {limit}"
        );
    }

    #[test]
    fn too_few_answers_judge_nothing() {
        let s = fed(400, 25, 100);
        assert_eq!(s.learned(0, 8, 1).request_limit, None);
        let blind = {
            let mut s = SloState::default();
            for _ in 0..1_000 {
                s.observe(
                    0,
                    &Observation::Decoded {
                        tpot_ms: 500,
                        in_flight: None,
                    },
                    &TARGETS,
                    1,
                );
            }
            s
        };
        assert_eq!(
            blind.learned(0, 8, 1).request_limit,
            None,
            "ranks that do not count requests"
        );
    }

    #[test]
    fn a_straggler_lowers_the_limit_and_a_recovery_lifts_it() {
        let mut s = fed(400, 25, 20_000);
        // Every answer now misses from 100 requests up, fed where the limit
        // lets the worker be.
        for i in 0..3_000u64 {
            let limit = s.learned(0, 8, 1).request_limit.map_or(800, |l| l * 8);
            let n = limit.saturating_sub(i % 40).max(8);
            let missed = n >= 100 || i % 25 == 0;
            s.observe(0, &decoded(if missed { 60 } else { 40 }, n), &TARGETS, 1);
        }
        let slow = s.learned(0, 8, 1).request_limit.unwrap() * 8;
        assert!(slow <= 128, "down near 100: {slow}");
        for i in 0..30_000u64 {
            let limit = s.learned(0, 8, 1).request_limit.map_or(800, |l| l * 8);
            let n = (limit + 40).saturating_sub(i % 80).max(8);
            let missed = n >= 400 || i % 25 == 0;
            s.observe(0, &decoded(if missed { 60 } else { 40 }, n), &TARGETS, 1);
        }
        let recovered = s.learned(0, 8, 1).request_limit.map_or(u64::MAX, |l| l * 8);
        assert!(recovered >= 300, "faded bins let it climb back: {recovered}");
    }

    #[test]
    fn what_no_answer_confirmed_lately_is_forgotten() {
        let mut s = fed(400, 25, 20_000);
        s.observe(2, &first(900, 100), &TARGETS, 1_000);
        let learned = s.learned(2, 8, 1_000 + FORGET_AFTER_MS);
        assert_eq!(learned.margin_ms, Some(800));
        assert!(
            learned.request_limit.is_none(),
            "the decodes were applied at 1 ms"
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
