//! The saturation detector dprank judges pools with ([`ExpectedWait`]): a
//! rank is saturated past its class's limits by its expected wait, its KV
//! use or the requests on it (`worker_state::saturation`); a pool has room
//! as soon as one candidate rank has it.

use super::{Overloaded, SaturationDetector};
use crate::worker_state::saturation::{excess_ms, Limits};
use crate::worker_state::RankQueue;

/// What a pool's ranks say about one more request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judgement {
    /// Some rank has room.
    Room,
    /// No rank to judge (no fresh data, or none in rotation).
    NoData,
    /// Every rank is saturated; the least saturated is `retry_after_ms`
    /// of wait past the limit (how long until it has room, as far as known).
    Overloaded(Overloaded),
}

/// Expected wait, KV use and requests on a rank, against the class's
/// limits (docs/overload.md, "The saturation rule").
#[derive(Debug, Clone, Copy, Default)]
pub struct ExpectedWait;

impl SaturationDetector for ExpectedWait {
    fn judge(&self, candidates: impl IntoIterator<Item = RankQueue>, limits: &Limits) -> Judgement {
        let mut least: Option<u64> = None;
        let mut ranks = 0u32;
        for q in candidates {
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
            Some(least) => Judgement::Overloaded(Overloaded {
                retry_after_ms: least.max(1),
                saturated_ranks: ranks,
            }),
        }
    }

    fn is_saturated(&self, rank: &RankQueue, limits: &Limits) -> bool {
        excess_ms(rank, limits).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn busy(tokens: u64) -> RankQueue {
        RankQueue {
            tokens: Some(tokens),
            requests: 1,
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
    fn a_pool_has_room_if_one_rank_has_and_else_says_how_long_to_wait() {
        let d = ExpectedWait;
        assert_eq!(d.judge([busy(30_000), busy(5_000)], &LIMITS), Judgement::Room);
        assert_eq!(
            d.judge([busy(30_000), busy(15_000)], &LIMITS),
            Judgement::Overloaded(Overloaded {
                retry_after_ms: 500,
                saturated_ranks: 2
            })
        );
        assert_eq!(d.judge(std::iter::empty(), &LIMITS), Judgement::NoData);
        assert!(d.is_saturated(&busy(10_001), &LIMITS));
        assert!(!d.is_saturated(&busy(10_000), &LIMITS), "exactly at the limit");
    }
}
