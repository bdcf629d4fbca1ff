//! Scorer `queue` (prefix affinity): adds the work queued on each rank ahead
//! of the request, measured as `prefix_queue` says (`worker_state/prefill.rs`):
//! its uncached prompt tokens, plus `prefix_wait_weight` per queued request.

use crate::cost::{add_cost, weighted, Slot};
use crate::scheduler::{Context, Scorer, WorkerView};

pub struct Queue;

impl Scorer for Queue {
    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Slot]) {
        let Some(prefix) = ctx.prefix else {
            return;
        };
        let (measure, per_request) = (prefix.settings.queue, prefix.settings.wait_weight);
        for (rank, cost) in costs.iter_mut().enumerate() {
            let queued = worker.state.prefill.queued(rank, measure);
            add_cost(
                cost,
                queued
                    .tokens
                    .saturating_add(weighted(queued.requests, per_request)),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::prefix::PromptBlocks;
    use crate::scheduler::testing::*;
    use crate::scheduler::Constraint;
    use crate::worker_state::{Charge, RankFigures};

    #[test]
    fn adds_the_prefill_queued_on_each_rank() {
        let config =
            Config::from_json(br#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_queue":"polled"}"#).unwrap();
        let settings = config.prefix.clone().unwrap();
        let prefix = prefix_request(&settings, PromptBlocks::default(), 0);
        let w = worker("a", 1, None);
        let mut s = state(&[0, 0], 1000);
        let figures = [
            RankFigures {
                waiting_uncached: Some(300),
                ..Default::default()
            },
            RankFigures::default(),
        ];
        s.apply_figures(s.snapshot_seq, &figures);
        s.charge_prefill(
            0,
            1,
            Charge {
                prompt: 90,
                cached: 10,
            },
            true,
        );
        let view = WorkerView {
            index: 0,
            worker: &w,
            state: &s,
            loads: &[],
        };
        let ctx = Context {
            prefix: Some(&prefix),
            ..ctx(Constraint::default())
        };
        let mut costs = vec![1, 1];
        Queue.score(&ctx, &view, &mut costs);
        assert_eq!(costs, vec![301, 81]);
    }
}
