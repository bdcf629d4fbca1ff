//! Scorer `load`: adds each rank's effective tokens (the last polled figure
//! plus the estimates of requests the poll has not seen yet, as derived in
//! `LoadTable`); a rank the report gave no usable figure for is removed. Under
//! prefix affinity the tokens are weighted by `prefix_load_weight`. Where
//! `prefix_load` costs a request by its worker's lockstep, the `lockstep`
//! scorer adds the load instead (`applies`).

use crate::cost::{add_cost, weighted, Slot, MAX_COST, REMOVED};
use crate::scheduler::{Context, Scorer, WorkerView};

pub struct Load;

impl Scorer for Load {
    fn applies(&self, ctx: &Context) -> bool {
        !ctx.prefix
            .is_some_and(|p| p.settings.load.lockstep(p.held_nowhere()))
    }

    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Slot]) {
        let weight = ctx.prefix.map_or(1.0, |a| a.settings.load_weight);
        if weight == 1.0 {
            // Load only: selects rather than branches, a few instructions a
            // rank; removed if either is (`REMOVED` is the largest slot).
            for (cost, &load) in costs.iter_mut().zip(worker.loads) {
                let sum = cost.saturating_add(load).min(MAX_COST);
                *cost = if (*cost).max(load) == REMOVED {
                    REMOVED
                } else {
                    sum
                };
            }
        } else {
            for (cost, load) in costs.iter_mut().zip(worker.loads) {
                if *load == REMOVED {
                    *cost = REMOVED;
                } else {
                    add_cost(cost, weighted(*load, weight));
                }
            }
        }
        remove_unlisted(worker, costs);
    }
}

/// Removes the ranks past those the worker's state lists.
#[inline(always)]
pub(in crate::scheduler) fn remove_unlisted(worker: &WorkerView, costs: &mut [Slot]) {
    // Checked first: a fill of nothing still calls `memset`.
    if costs.len() > worker.loads.len() {
        if let Some(unlisted) = costs.get_mut(worker.loads.len()..) {
            unlisted.fill(REMOVED);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::prefix::PromptBlocks;
    use crate::scheduler::testing::*;
    use crate::scheduler::{Constraint, WorkerView};
    use crate::worker_state::WorkerState;

    /// `state`'s costs as scored in `ctx`, `state` being worker 0.
    fn score_in(ctx: &Context, state: &WorkerState, mut costs: Vec<Slot>) -> Vec<Slot> {
        let w = worker("a", 1, None);
        let loads = crate::scheduler::LoadTable::of(std::slice::from_ref(&Some(state.clone())));
        let view = WorkerView {
            index: 0,
            worker: &w,
            state,
            loads: loads.worker(0),
        };
        Load.score(ctx, &view, &mut costs);
        costs
    }

    fn score(state: &WorkerState, costs: Vec<Slot>) -> Vec<Slot> {
        score_in(&ctx(Constraint::default()), state, costs)
    }

    /// `state`'s costs under prefix affinity as `config` sets it, for a
    /// request of `blocks`.
    fn score_with_prefix(
        config: &Config,
        blocks: PromptBlocks,
        state: &WorkerState,
        costs: Vec<Slot>,
    ) -> Vec<Slot> {
        let settings = config.prefix.clone().unwrap();
        let prefix = prefix_request(&settings, blocks, 0);
        let ctx = Context {
            prefix: Some(&prefix),
            ..ctx(Constraint::default())
        };
        score_in(&ctx, state, costs)
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

    #[test]
    fn prefix_affinity_weights_the_tokens() {
        let config = Config::from_json(
            br#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_load_weight":0.5,"prefix_load":"rank"}"#,
        )
        .unwrap();
        let s = state(&[100, 7, 0], 1000);
        let costs = score_with_prefix(&config, PromptBlocks::default(), &s, vec![3, 3, REMOVED]);
        assert_eq!(costs, vec![53, 7, REMOVED]);
    }

    #[test]
    fn leaves_a_request_the_lockstep_rule_costs_to_the_lockstep_scorer() {
        let config = |load: &str| {
            Config::from_json(
                format!(r#"{{"workers":[{{"address":"127.0.0.1:1"}}],"prefix_load":"{load}"}}"#).as_bytes(),
            )
            .unwrap()
        };
        for (load, applies) in [
            ("rank", true),
            ("slowest_rank", false),
            ("slowest_rank_when_uncached", false),
        ] {
            let settings = config(load).prefix.unwrap();
            let prefix = prefix_request(&settings, PromptBlocks::default(), 0);
            let ctx = Context {
                prefix: Some(&prefix),
                ..ctx(Constraint::default())
            };
            assert_eq!(Load.applies(&ctx), applies, "{load}: a prompt no rank holds");
        }
        assert!(Load.applies(&ctx(Constraint::default())), "no prefix affinity");
    }
}
