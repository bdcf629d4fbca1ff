//! Filter `healthy`: drops workers Envoy reports unhealthy and workers
//! passive health ejected, and clears ejected ranks (`health.rs`). A worker
//! or rank past its cooldown stays only for the requests that may probe it.

use crate::cost::{Slot, REMOVED};
use crate::scheduler::{Context, Filter, WorkerView};

pub struct Healthy;

impl Filter for Healthy {
    /// A healthy fleet's record is empty: nothing to check per worker.
    fn applies(&self, ctx: &Context) -> bool {
        !ctx.health.is_empty()
    }

    fn filter(&self, ctx: &Context, worker: &WorkerView, ranks: &mut [Slot]) -> bool {
        let Some(ranks_out) = ctx
            .health
            .admitted(worker.worker.address, ctx.now_ms, ctx.admit_probing)
        else {
            return false;
        };
        for rank in ranks_out {
            if let Some(slot) = ranks.get_mut(rank as usize) {
                *slot = REMOVED;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::{Health, Outcome, Target};
    use crate::scheduler::testing::*;
    use crate::scheduler::{Constraint, Context};

    #[test]
    fn drops_ejected_and_envoy_unhealthy_workers_and_clears_ejected_ranks() {
        let (a, b) = (worker("a", 1, None), worker("b", 2, None));
        let s = state(&[1, 1, 1], 1000);
        let policy = policy();
        let mut health = Health::default();
        for _ in 0..3 {
            let t = Target {
                worker: a.address,
                rank: None,
            };
            health.observe(&policy, t, Outcome::Failure, 500, 500);
            let r1 = Target {
                worker: b.address,
                rank: Some(1),
            };
            health.observe(&policy, r1, Outcome::Failure, 500, 500);
        }
        assert!(
            !Healthy.applies(&ctx(Constraint::default())),
            "an empty record: not run at all"
        );
        let ctx = Context {
            health: &health,
            ..ctx(Constraint::default())
        };
        assert!(Healthy.applies(&ctx));
        assert_eq!(run_filter(&Healthy, &ctx, 0, &a, &s), None, "a is ejected");
        assert_eq!(
            run_filter(&Healthy, &ctx, 1, &b, &s),
            Some(vec![0, REMOVED, 0]),
            "only b's rank 1 is"
        );
        // Past the cooldown (1000 ms from 500): only probes see them.
        let later = Context { now_ms: 1600, ..ctx };
        assert_eq!(run_filter(&Healthy, &later, 0, &a, &s), None);
        let probe = Context {
            admit_probing: true,
            ..later
        };
        assert_eq!(run_filter(&Healthy, &probe, 0, &a, &s), Some(vec![0; 3]));
        assert_eq!(run_filter(&Healthy, &probe, 1, &b, &s), Some(vec![0; 3]));

        let mut envoy = Health::default();
        envoy.envoy_unhealthy.push(b.address);
        let ctx = Context {
            health: &envoy,
            admit_probing: true,
            ..ctx
        };
        assert_eq!(
            run_filter(&Healthy, &ctx, 1, &b, &s),
            None,
            "Envoy's view is never probed"
        );
        assert!(run_filter(&Healthy, &ctx, 0, &a, &s).is_some());
    }
}
