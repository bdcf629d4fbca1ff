//! Scorer `load`: adds each rank's effective tokens (the last polled figure
//! plus the estimates of requests the poll has not seen yet); a rank the
//! report gave no usable figure for is removed. Under prefix affinity the
//! tokens are weighted by `prefix_load_weight`.

use super::{Context, Scorer, WorkerView};
use crate::prefix::affinity::weighted;

pub struct Load;

impl Scorer for Load {
    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Option<u64>]) {
        let Some(affinity) = ctx.affinity else {
            worker.state.add_effective_tokens(costs);
            return;
        };
        let weight = affinity.settings.load_weight;
        for (rank, cost) in costs.iter_mut().enumerate() {
            *cost = match (*cost, worker.state.effective_tokens(rank)) {
                (Some(c), Some(tokens)) => Some(c.saturating_add(weighted(tokens, weight))),
                _ => None,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::{Constraint, WorkerView};
    use super::*;
    use crate::config::Config;
    use crate::host::fake::FakeHost;
    use crate::prefix::{Affinity, PromptBlocks};
    use crate::state::WorkerState;

    fn score(state: &WorkerState, mut costs: Vec<Option<u64>>) -> Vec<Option<u64>> {
        let w = worker("a", 1, None);
        let view = WorkerView {
            index: 0,
            worker: &w,
            state,
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

    #[test]
    fn prefix_affinity_weights_the_tokens() {
        let config =
            Config::from_json(br#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_load_weight":0.5}"#)
                .unwrap();
        let settings = config.prefix.clone().unwrap();
        let h = FakeHost::default();
        let affinity = Affinity::new(&config, &settings, &h, 0, PromptBlocks::default(), true, 0);
        let w = worker("a", 1, None);
        let s = state(&[100, 7, 0], 1000);
        let view = WorkerView {
            index: 0,
            worker: &w,
            state: &s,
        };
        let ctx = Context {
            affinity: Some(&affinity),
            ..ctx(Constraint::default())
        };
        let mut costs = vec![Some(3), Some(3), None];
        Load.score(&ctx, &view, &mut costs);
        assert_eq!(costs, vec![Some(53), Some(7), None]);
    }
}
