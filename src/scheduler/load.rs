//! Scorer `load`: adds each rank's effective tokens (the last polled figure
//! plus the estimates of requests the poll has not seen yet, as derived in
//! `Loads`); a rank the report gave no usable figure for is removed.

use super::{Context, Scorer, Slot, WorkerView, MAX_COST, REMOVED};

pub struct Load;

impl Scorer for Load {
    fn score(&self, _ctx: &Context, worker: &WorkerView, costs: &mut [Slot]) {
        for (cost, load) in costs.iter_mut().zip(worker.loads) {
            *cost = if *cost == REMOVED || *load == REMOVED {
                REMOVED
            } else {
                cost.saturating_add(*load).min(MAX_COST)
            };
        }
        if let Some(unlisted) = costs.get_mut(worker.loads.len()..) {
            unlisted.fill(REMOVED);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::{Constraint, WorkerView};
    use super::*;
    use crate::state::WorkerState;

    fn score(state: &WorkerState, mut costs: Vec<Slot>) -> Vec<Slot> {
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
        assert_eq!(score(&s, vec![0, 0]), vec![15, 6]);
        assert_eq!(
            score(&s, vec![1, REMOVED]),
            vec![16, REMOVED],
            "removed stays removed"
        );
        assert_eq!(
            score(&s, vec![0, 0, 0]),
            vec![15, 6, REMOVED],
            "a rank the state does not list"
        );
        assert_eq!(
            score(&s, vec![MAX_COST, 0]),
            vec![MAX_COST, 6],
            "costs saturate below REMOVED"
        );
    }

    #[test]
    fn ranks_without_a_figure_are_removed() {
        let mut s = WorkerState::default();
        let seq = s.begin_poll();
        s.apply_snapshot(seq, 1, &[None, Some(4)]);
        assert_eq!(score(&s, vec![0; 2]), vec![REMOVED, 4]);
    }
}
