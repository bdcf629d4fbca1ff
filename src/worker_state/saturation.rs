//! Overload protection's saturation rule, pure: a rank's expected wait
//! from its queue ([`RankQueue`]), whether it has room, and whether a pool
//! has. Admission judges pools by it (`router/admission`), and the
//! scheduler's `unsaturated` filter keeps saturated ranks out of a choice
//! while others have room. docs/overload.md says why it reads what it
//! reads.

use super::{RankQueue, WorkerState};

/// What makes a rank saturated for a request of one class
/// (`config::Admission`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    pub max_wait_ms: u64,
    pub max_kv_usage: Option<f64>,
    /// A rank with this many requests on it (running and waiting) has no
    /// room for another.
    pub max_requests: Option<u64>,
}

/// Everything needed to judge a rank from its state: the limits, the
/// configured drain rate and whether it is learned.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Room {
    pub limits: Limits,
    pub prior_tokens_per_s: f64,
    pub learn: bool,
}

impl Room {
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
    if wait > limits.max_wait_ms {
        return Some(wait - limits.max_wait_ms);
    }
    let kv_full = matches!((q.kv_usage, limits.max_kv_usage), (Some(kv), Some(max)) if kv >= max);
    let busy = matches!((q.in_flight, limits.max_requests), (Some(n), Some(max)) if n >= max);
    (kv_full || busy).then_some(limits.max_wait_ms)
}

/// What a pool's ranks say about one more request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judgement {
    /// Some rank has room.
    Room,
    /// No rank to judge (no fresh data, or none in rotation).
    NoData,
    /// Every rank is saturated; the least saturated is this many ms of
    /// wait past the limit (how long until it has room, as far as known).
    Saturated { ranks: u32, retry_after_ms: u64 },
}

/// Judges the candidate ranks of a pool: room as soon as one has it.
pub fn judge(queues: impl IntoIterator<Item = RankQueue>, limits: &Limits) -> Judgement {
    let mut least: Option<u64> = None;
    let mut ranks = 0u32;
    for q in queues {
        match excess_ms(&q, limits) {
            None => return Judgement::Room,
            Some(excess) => {
                ranks += 1;
                least = Some(least.map_or(excess, |l| l.min(excess)));
            }
        }
    }
    match least {
        None => Judgement::NoData,
        Some(least) => Judgement::Saturated {
            ranks,
            retry_after_ms: least.max(1),
        },
    }
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
        }
    }

    const LIMITS: Limits = Limits {
        max_wait_ms: 1000,
        max_kv_usage: None,
        max_requests: None,
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

    #[test]
    fn a_pool_has_room_if_one_rank_has_and_else_says_how_long_to_wait() {
        let busy = |t| queue(Some(t), 1);
        assert_eq!(judge([busy(30_000), busy(5_000)], &LIMITS), Judgement::Room);
        assert_eq!(
            judge([busy(30_000), busy(15_000)], &LIMITS),
            Judgement::Saturated {
                ranks: 2,
                retry_after_ms: 500
            }
        );
        assert_eq!(judge(std::iter::empty(), &LIMITS), Judgement::NoData);
    }
}
