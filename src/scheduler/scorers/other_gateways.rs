//! Scorer `other_gateways` (`gateways` > 1): counts this gateway's requests since the
//! last poll `gateways - 1` more times. Gateways sharing a fleet each see
//! their own requests between polls; the others, spread alike by the L4
//! balancer, are sending about as many, so the work a rank got since the
//! poll is about `gateways` times this gateway's. Without it every gateway
//! keeps sending to the stale minimum until its next poll.

use crate::cost::{add_cost, weighted, Slot};
use crate::scheduler::{Context, Scorer, WorkerView};

pub struct OtherGateways;

impl Scorer for OtherGateways {
    /// Alone on the fleet there are no others' requests to count.
    fn applies(&self, ctx: &Context) -> bool {
        ctx.gateways > 1
    }

    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Slot]) {
        let others = u64::from(ctx.gateways.saturating_sub(1));
        if others == 0 {
            return;
        }
        let settings = ctx.prefix.map(|a| a.settings);
        for (rank, cost) in costs.iter_mut().enumerate() {
            let pending = worker.state.pending_tokens(rank).saturating_mul(others);
            let extra = match settings {
                None => pending,
                Some(s) => {
                    // The queue scorer's own-requests-since-poll share, and the load's.
                    let since = worker.state.prefill.since_poll(rank);
                    since
                        .tokens
                        .saturating_mul(others)
                        .saturating_add(weighted(since.requests.saturating_mul(others), s.wait_weight))
                        .saturating_add(weighted(pending, s.load_weight))
                }
            };
            add_cost(cost, extra);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::REMOVED;
    use crate::scheduler::testing::*;
    use crate::scheduler::{Constraint, WorkerView};
    use crate::worker_state::LoadTable;

    #[test]
    fn counts_own_requests_since_the_poll_once_per_other_gateway() {
        let w = worker("a", 1, None);
        let mut s = state(&[100, 100], 1000);
        s.add(0, 0, 10);
        let loads = LoadTable::of(std::slice::from_ref(&Some(s.clone())));
        let view = WorkerView {
            index: 0,
            worker: &w,
            state: &s,
            loads: loads.worker(0),
        };
        let score = |gateways| {
            let ctx = Context {
                gateways,
                ..ctx(Constraint::default())
            };
            let mut costs = vec![1, 1, REMOVED];
            OtherGateways.score(&ctx, &view, &mut costs);
            costs
        };
        assert_eq!(score(1), vec![1, 1, REMOVED], "alone: nothing");
        assert_eq!(score(4), vec![31, 1, REMOVED], "three others send alike");
        assert_eq!(score(0), vec![1, 1, REMOVED]);
    }
}
