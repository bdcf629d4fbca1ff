//! Scorer `load`: adds each rank's effective tokens (the last polled figure
//! plus the estimates of requests the poll has not seen yet, as derived in
//! `LoadTable`); a rank the report gave no usable figure for is removed. Under
//! prefix affinity the tokens are weighted by `prefix_load_weight`, and with
//! `prefix_load: "slowest_rank"` a rank is costed by its worker's slowest
//! (with `"slowest_rank_when_uncached"`, SGLang's default, for prompts no rank
//! holds).

use crate::config::prefix::DEFAULT_CAPACITY_TOKENS;
use crate::config::LoadMeasure;
use crate::cost::{add_cost, weighted, Slot, MAX_COST, REMOVED};
use crate::scheduler::{Context, Scorer, WorkerView};

pub struct Load;

/// How much raising a worker's slowest rank costs, per rank it slows, when
/// that rank is full (chosen on tuning seeds: docs/prefix-affinity.md).
pub const RAISE_WEIGHT: f64 = 0.75;
/// The slowest rank's tokens count at most this many times its capacity
/// (they include queued prompts, which can exceed it).
const MAX_FULLNESS: f64 = 2.0;

impl Scorer for Load {
    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Slot]) {
        let weight = ctx.prefix.map_or(1.0, |a| a.settings.load_weight);
        let slowest = ctx.prefix.filter(|a| match a.settings.load {
            LoadMeasure::SlowestRank => true,
            LoadMeasure::SlowestRankWhenUncached => a.held_nowhere(),
            LoadMeasure::Rank => false,
        });
        if let Some(prefix) = slowest {
            let capacity = prefix
                .settings
                .capacity_tokens
                .or(worker.state.prefill.capacity(0))
                .unwrap_or(DEFAULT_CAPACITY_TOKENS);
            Self::add_slowest(weight, prefix.prompt.tokens(), capacity, worker.loads, costs);
        } else if weight == 1.0 {
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
            Self::add_weighted(weight, worker.loads, costs);
        }
        // Checked first: a fill of nothing still calls `memset`.
        if costs.len() > worker.loads.len() {
            if let Some(unlisted) = costs.get_mut(worker.loads.len()..) {
                unlisted.fill(REMOVED);
            }
        }
    }
}

impl Load {
    /// `LoadMeasure::SlowestRank`: under DP attention a worker's ranks step
    /// together, as slowly as the most loaded one, so each rank costs that
    /// rank's tokens; a rank the request's `own` tokens would make the most
    /// loaded also costs what it raises that rank by, once for every rank
    /// it slows, in proportion to how full the slowest rank is (of
    /// `capacity` tokens) and [`RAISE_WEIGHT`]. docs/prefix-affinity.md.
    fn add_slowest(weight: f64, own: u64, capacity: u64, loads: &[Slot], costs: &mut [Slot]) {
        let slowest = loads
            .iter()
            .filter(|l| **l != REMOVED)
            .max()
            .copied()
            .unwrap_or(0);
        let fullness = (slowest as f64 / capacity.max(1) as f64).min(MAX_FULLNESS);
        let per_raised = RAISE_WEIGHT * loads.len() as f64 * fullness;
        for (cost, load) in costs.iter_mut().zip(loads) {
            if *load == REMOVED {
                *cost = REMOVED;
            } else {
                let raised = load.saturating_add(own).saturating_sub(slowest);
                add_cost(cost, weighted(slowest, weight));
                add_cost(cost, weighted(raised, weight * per_raised));
            }
        }
    }

    fn add_weighted(weight: f64, loads: &[Slot], costs: &mut [Slot]) {
        for (cost, load) in costs.iter_mut().zip(loads) {
            if *load == REMOVED {
                *cost = REMOVED;
            } else {
                add_cost(cost, weighted(*load, weight));
            }
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
    fn slowest_rank_costs_the_worker_s_slowest_and_what_a_request_raises_it_by() {
        // Capacity 1000 tokens; a 256-byte prompt is 64 tokens.
        let config = Config::from_json(
            br#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_load_weight":1,"prefix_load":"slowest_rank","prefix_capacity_tokens":1000,"prefix_block_bytes":64}"#,
        )
        .unwrap();
        let body = format!(r#"{{"text":"{}"}}"#, "p".repeat(256));
        let object = crate::body::JsonObject::parse(body.as_bytes()).unwrap();
        let s = state(&[500, 480, 100, 0], 1000);
        let costs = score_with_prefix(&config, PromptBlocks::of(&object, 64), &s, vec![0; 4]);
        // Every rank costs the slowest (500). Rank 0 would rise by 64,
        // rank 1 by 44, slowed for 4 ranks at half full: x 0.75 x 4 x 0.5.
        assert_eq!(costs, vec![500 + 96, 500 + 66, 500, 500]);
        assert_eq!(config.prefix.unwrap().load, LoadMeasure::SlowestRank);
    }

    #[test]
    fn slowest_rank_when_uncached_costs_by_the_slowest_only_a_prompt_no_rank_holds() {
        use crate::codec::encode;
        use crate::prefix::index::IndexRecord;
        let config = Config::from_json(
            br#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_load_weight":1,"prefix_load":"slowest_rank_when_uncached","prefix_capacity_tokens":1000,"prefix_block_bytes":64}"#,
        )
        .unwrap();
        let settings = config.prefix.clone().unwrap();
        let body = format!(r#"{{"text":"{}"}}"#, "p".repeat(256));
        let object = crate::body::JsonObject::parse(body.as_bytes()).unwrap();
        let blocks = PromptBlocks::of(&object, 64);
        let s = state(&[500, 480, 100, 0], 1000);
        let scored = |prefix: &crate::prefix::RequestPrefix| {
            let ctx = Context {
                prefix: Some(prefix),
                ..ctx(Constraint::default())
            };
            score_in(&ctx, &s, vec![0; 4])
        };
        // Held nowhere: as `slowest_rank` (the test above).
        let new_prompt = prefix_request(&settings, blocks.clone(), 0);
        assert_eq!(scored(&new_prompt), vec![500 + 96, 500 + 66, 500, 500]);
        // Held on rank 2: as `rank`, each rank its own tokens.
        let index = IndexRecord::holding(2, &blocks.hash_chains(), 1_000_000);
        let mut held = prefix_request(&settings, blocks, 0);
        held.insert(0, Some((encode(&index), 1)));
        assert!(!held.held_nowhere());
        assert_eq!(scored(&held), vec![500, 480, 100, 0]);
    }
}
