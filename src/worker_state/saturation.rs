//! Overload protection's saturation rule for one rank, pure: its expected
//! wait from its queue ([`RankQueue`]) and whether it has room under a
//! class's [`Limits`]. Admission's saturation detector judges pools by it
//! (`admission/saturation.rs`), and the scheduler's `unsaturated` filter
//! keeps saturated ranks out of a choice while others have room.
//! docs/overload.md says why it reads what it reads.

use super::{slo, RankQueue, WorkerState};

/// What makes a rank saturated for a request of one class
/// (`config::Admission`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    pub max_wait_ms: u64,
    pub max_kv_usage: Option<f64>,
    /// A rank with this many requests on it (running and waiting) has no
    /// room for another.
    pub max_requests: Option<u64>,
    /// SLO admission: the class's targets, which what each rank learned
    /// turns into its own limits, under the caps above.
    pub slo: Option<ClassSlo>,
}

/// A class's share of what SLO admission learns per rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClassSlo {
    /// The TTFT target (ms): the wait budget on a rank is this less the
    /// rank's first-token margin.
    pub ttft_ms: u64,
    /// The class's share of the wait budget and of the learned request
    /// limit (1 for the default class, which they are learned for).
    pub share: f64,
}

impl Limits {
    /// The wait limit on the rank of `q`: the configured one, or the
    /// class's wait budget there if SLO admission learned less.
    pub fn max_wait_on(&self, q: &RankQueue) -> u64 {
        match (self.slo, q.learned.margin_ms) {
            (Some(s), Some(margin)) => {
                let budget = slo::wait_budget_ms(s.ttft_ms, margin) as f64 * s.share;
                self.max_wait_ms.min(budget.round() as u64)
            }
            _ => self.max_wait_ms,
        }
    }

    /// The request limit on the rank of `q`: the configured one, or the
    /// class's share of the rank's learned one if lower.
    pub fn max_requests_on(&self, q: &RankQueue) -> Option<u64> {
        let learned = self
            .slo
            .zip(q.learned.request_limit)
            .map(|(s, limit)| ((limit as f64 * s.share).ceil() as u64).max(1));
        match (self.max_requests, learned) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// Admission's rule for a request: everything needed to judge a rank from
/// its state (the class's limits, the configured drain rate and whether it
/// is learned).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rule {
    pub limits: Limits,
    pub prior_tokens_per_s: f64,
    pub learn: bool,
}

/// The scheduler's name for [`Rule`] (its `Context::room`), until it says `Rule`.
pub type Room = Rule;

impl Rule {
    /// `rank`'s queue as `state` holds it.
    pub fn queue(&self, state: &WorkerState, rank: usize) -> RankQueue {
        state.rank_queue(rank, self.prior_tokens_per_s, self.learn)
    }

    /// Whether `rank` of `state` has room.
    pub fn has_room(&self, state: &WorkerState, rank: usize) -> bool {
        excess_ms(&self.queue(state, rank), &self.limits).is_none()
    }
}

/// How long a request sent to the rank now would wait before its prefill
/// starts, in ms: the prompt tokens queued ahead of it over the rate the
/// queue drains at. Its own prompt is not counted: a long prompt on an
/// idle rank does not wait, and must not be refused for its length (the
/// limit is set below the TTFT target by a long prompt's prefill time).
/// A rank whose reports do not count tokens (vLLM) is taken to queue its
/// waiting requests at the mean prompt of the gateway's requests.
pub fn expected_wait_ms(q: &RankQueue) -> u64 {
    let tokens = q
        .tokens
        .map_or(q.requests as f64 * q.mean_request_tokens, |t| t as f64);
    let ms = tokens / q.drain_tokens_per_s.max(1.0) * 1000.0;
    if ms.is_finite() {
        ms.ceil().min(u64::MAX as f64) as u64
    } else {
        u64::MAX
    }
}

/// How far past its limit a rank is, in ms of wait (None: it has room).
/// A rank saturated by its KV use or its requests alone is counted
/// `max_wait_ms` past it: how soon it frees memory or a request ends is
/// not known.
pub fn excess_ms(q: &RankQueue, limits: &Limits) -> Option<u64> {
    let wait = expected_wait_ms(q);
    let max_wait = limits.max_wait_on(q);
    if wait > max_wait {
        return Some(wait - max_wait);
    }
    let kv_full = matches!((q.kv_usage, limits.max_kv_usage), (Some(kv), Some(max)) if kv >= max);
    let busy = matches!((q.in_flight, limits.max_requests_on(q)), (Some(n), Some(max)) if n >= max);
    (kv_full || busy).then_some(max_wait)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(tokens: Option<u64>, requests: u64) -> RankQueue {
        RankQueue {
            tokens,
            requests,
            mean_request_tokens: 500.0,
            kv_usage: None,
            in_flight: None,
            drain_tokens_per_s: 10_000.0,
            learned: Default::default(),
        }
    }

    const LIMITS: Limits = Limits {
        max_wait_ms: 1000,
        max_kv_usage: None,
        max_requests: None,
        slo: None,
    };

    #[test]
    fn the_wait_is_the_queued_tokens_over_the_drain_rate() {
        assert_eq!(expected_wait_ms(&queue(Some(0), 0)), 0);
        assert_eq!(expected_wait_ms(&queue(Some(5_000), 3)), 500);
        assert_eq!(expected_wait_ms(&queue(Some(1), 0)), 1, "rounded up");
        let slow = RankQueue {
            drain_tokens_per_s: 500.0,
            ..queue(Some(5_000), 3)
        };
        assert_eq!(expected_wait_ms(&slow), 10_000);
    }

    #[test]
    fn without_token_counts_waiting_requests_count_at_the_mean_prompt() {
        assert_eq!(expected_wait_ms(&queue(None, 40)), 2000);
        assert_eq!(expected_wait_ms(&queue(None, 0)), 0);
    }

    #[test]
    fn a_rank_is_saturated_past_the_wait_or_the_kv_limit() {
        assert_eq!(excess_ms(&queue(Some(10_000), 1), &LIMITS), None, "exactly at it");
        assert_eq!(excess_ms(&queue(Some(10_001), 1), &LIMITS), Some(1));
        let full = RankQueue {
            kv_usage: Some(0.97),
            ..queue(Some(0), 0)
        };
        assert_eq!(excess_ms(&full, &LIMITS), None, "no KV rule by default");
        let kv = Limits {
            max_kv_usage: Some(0.95),
            ..LIMITS
        };
        assert_eq!(excess_ms(&full, &kv), Some(1000));
    }

    #[test]
    fn a_rank_with_as_many_requests_as_allowed_has_no_room() {
        let with = |n: Option<u64>| RankQueue {
            in_flight: n,
            ..queue(Some(0), 0)
        };
        assert_eq!(
            excess_ms(&with(Some(500)), &LIMITS),
            None,
            "no request rule by default"
        );
        let capped = Limits {
            max_requests: Some(32),
            ..LIMITS
        };
        assert_eq!(excess_ms(&with(Some(31)), &capped), None);
        assert_eq!(excess_ms(&with(Some(32)), &capped), Some(1000), "the 33rd waits");
        assert_eq!(
            excess_ms(&with(None), &capped),
            None,
            "running not reported: the wait alone"
        );
    }
}
