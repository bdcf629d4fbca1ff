//! Scorer `load`: adds each rank's effective tokens (the last polled figure
//! plus the estimates of requests the poll has not seen yet, as derived in
//! `Loads`); a rank the report gave no usable figure for is removed.

use super::{Context, Scorer, WorkerView};

pub struct Load;

impl Scorer for Load {
    fn score(&self, _ctx: &Context, worker: &WorkerView, costs: &mut [Option<u64>]) {
        for (cost, load) in costs.iter_mut().zip(worker.loads) {
            *cost = match (*cost, *load) {
                (Some(c), Some(l)) => Some(c.saturating_add(l)),
                _ => None,
            };
        }
        for cost in costs.iter_mut().skip(worker.loads.len()) {
            *cost = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::{Constraint, WorkerView};
    use super::*;
    use crate::state::WorkerState;

    fn score(state: &WorkerState, mut costs: Vec<Option<u64>>) -> Vec<Option<u64>> {
        let w = worker("a", 1, None);
        let loads = super::super::Loads::of(std::slice::from_ref(&Some(state.clone())));
        let view = WorkerView {
            index: 0,
            worker: &w,
            state,
            loads: loads.worker(0),
        };
        Load.score(&ctx(Constraint::default()), &view, &mut costs);
        costs
    }

    #[test]
    fn adds_polled_tokens_and_pending_estimates() {
        let mut s = state(&[5, 6], 1000);
        s.add(0, 0, 10);
        assert_eq!(score(&s, vec![Some(0), Some(0)]), vec![Some(15), Some(6)]);
        assert_eq!(
            score(&s, vec![Some(1), None]),
            vec![Some(16), None],
            "removed stays removed"
        );
    }

    #[test]
    fn ranks_without_a_figure_are_removed() {
        let mut s = WorkerState::default();
        let seq = s.begin_poll();
        s.apply_snapshot(seq, 1, &[None, Some(4)]);
        assert_eq!(score(&s, vec![Some(0); 2]), vec![None, Some(4)]);
    }
}
