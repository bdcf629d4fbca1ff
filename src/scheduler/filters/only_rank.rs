//! Filter `only_rank`: with a rank in the constraint (a trusted client's own
//! rank field), keeps only that rank of each worker; without, keeps all.

use crate::cost::{Slot, REMOVED};
use crate::scheduler::{Context, Filter, WorkerView};

pub struct OnlyRank;

impl Filter for OnlyRank {
    fn applies(&self, ctx: &Context) -> bool {
        ctx.constraint.only_rank.is_some()
    }

    fn filter(&self, ctx: &Context, _worker: &WorkerView, ranks: &mut [Slot]) -> bool {
        let Some(only) = ctx.constraint.only_rank else {
            return true;
        };
        let Some(kept) = ranks.get(only as usize).copied() else {
            return false;
        };
        ranks.fill(REMOVED);
        if let Some(slot) = ranks.get_mut(only as usize) {
            *slot = kept;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::testing::*;
    use crate::scheduler::Constraint;

    #[test]
    fn keeps_the_requested_rank_only() {
        let w = worker("a", 1, None);
        let s = state(&[1, 1, 1], 1000);
        let all = run_filter(&OnlyRank, &ctx(Constraint::default()), 0, &w, &s);
        assert_eq!(all, Some(vec![0; 3]));
        let only = |rank| Constraint {
            only_rank: Some(rank),
            pin: None,
        };
        let one = run_filter(&OnlyRank, &ctx(only(1)), 0, &w, &s);
        assert_eq!(one, Some(vec![REMOVED, 0, REMOVED]));
        assert_eq!(
            run_filter(&OnlyRank, &ctx(only(3)), 0, &w, &s),
            None,
            "a rank it does not have"
        );
    }
}
