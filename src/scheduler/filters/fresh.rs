//! Filter `fresh`: drops workers whose snapshot is older than the stale limit,
//! that were never polled, or that are out of rotation (a request to them
//! failed to connect).

use crate::cost::Slot;
use crate::scheduler::{Context, Filter, WorkerView};

pub struct Fresh;

impl Filter for Fresh {
    fn filter(&self, ctx: &Context, worker: &WorkerView, _ranks: &mut [Slot]) -> bool {
        worker.state.is_fresh(ctx.now_ms, ctx.stale_after_ms)
    }

    /// Looks at the state only.
    fn drops_whole_workers_only(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::testing::*;
    use crate::scheduler::Constraint;
    use crate::worker_state::WorkerState;

    #[test]
    fn drops_stale_unpolled_and_unreachable_workers() {
        let w = worker("a", 1, None);
        let ctx = ctx(Constraint::default()); // now 1000, stale after 3000
        assert!(run_filter(&Fresh, &ctx, 0, &w, &state(&[5, 6], 1000)).is_some());
        assert!(run_filter(&Fresh, &ctx, 0, &w, &state(&[5, 6], 0)).is_some());
        let at = |now_ms| Context { now_ms, ..ctx };
        assert!(run_filter(&Fresh, &at(4000), 0, &w, &state(&[5], 1000)).is_some());
        assert!(run_filter(&Fresh, &at(4001), 0, &w, &state(&[5], 1000)).is_none());
        assert!(run_filter(&Fresh, &ctx, 0, &w, &WorkerState::default()).is_none());
        let mut unreachable = state(&[5], 1000);
        unreachable.mark_unreachable();
        assert!(run_filter(&Fresh, &ctx, 0, &w, &unreachable).is_none());
    }
}
