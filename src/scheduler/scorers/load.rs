//! Scorer `load`: adds each rank's effective tokens (the last polled figure
//! plus the estimates of requests the poll has not seen yet, as derived in
//! `LoadTable`); a rank the report gave no usable figure for is removed. Under
//! prefix affinity the tokens are weighted by `prefix_load_weight`, and with
//! `prefix_load: "slowest_rank"` a rank is costed by its worker's lockstep
//! (with `"slowest_rank_when_uncached"`, SGLang's default, for prompts no rank
//! holds): its slowest rank and its longest prefill queue.

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
/// Under the lockstep rule each request a rank reported running counts as
/// this many tokens more (a decode step's time grows with its sequences, not
/// only their KV tokens; chosen on tuning seeds: docs/prefix-affinity-results.md).
pub const RUNNING_REQUEST_TOKENS: u64 = 3_000;
/// Under the lockstep rule, the weight of the worker's prefill horizon: the
/// longest prefill queued on any of its ranks, or the rank's queue plus the
/// prompt when that is longer (chosen on tuning seeds).
pub const PREFILL_HORIZON_WEIGHT: f64 = 0.5;

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
            let own = prefix.prompt.tokens();
            let running = |rank: usize| {
                RUNNING_REQUEST_TOKENS.saturating_mul(worker.state.prefill.running(rank).unwrap_or(0))
            };
            Self::add_slowest(weight, own, capacity, worker.loads, running, costs);
            let queued = |rank: usize| worker.state.prefill.queued(rank, prefix.settings.queue).tokens;
            Self::add_prefill_horizon(own, worker.loads.len(), queued, costs);
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
    /// rank's load (its tokens plus [`RUNNING_REQUEST_TOKENS`] per running
    /// request, `running`); a rank the request's `own` tokens (and one more
    /// request) would make the most loaded also costs what it raises that
    /// rank by, once for every rank it slows, in proportion to how full the
    /// slowest rank is (of `capacity` tokens) and [`RAISE_WEIGHT`].
    /// docs/prefix-affinity.md.
    fn add_slowest(
        weight: f64,
        own: u64,
        capacity: u64,
        loads: &[Slot],
        running: impl Fn(usize) -> u64,
        costs: &mut [Slot],
    ) {
        let lockstep = |rank: usize, load: Slot| load.saturating_add(running(rank));
        let slowest = loads
            .iter()
            .enumerate()
            .filter(|(_, l)| **l != REMOVED)
            .map(|(rank, l)| lockstep(rank, *l))
            .max()
            .unwrap_or(0);
        let fullness = (slowest as f64 / capacity.max(1) as f64).min(MAX_FULLNESS);
        let per_raised = RAISE_WEIGHT * loads.len() as f64 * fullness;
        // The request runs too, where the worker reports running requests.
        let own = match (0..loads.len()).any(|rank| running(rank) > 0) {
            true => own.saturating_add(RUNNING_REQUEST_TOKENS),
            false => own,
        };
        for (rank, (cost, load)) in costs.iter_mut().zip(loads).enumerate() {
            if *load == REMOVED {
                *cost = REMOVED;
            } else {
                let raised = lockstep(rank, *load).saturating_add(own).saturating_sub(slowest);
                add_cost(cost, weighted(slowest, weight));
                add_cost(cost, weighted(raised, weight * per_raised));
            }
        }
    }

    /// The lockstep rule's second half: a rank's prefill steps stall every
    /// rank of its worker, so the request costs [`PREFILL_HORIZON_WEIGHT`]
    /// times the worker's prefill horizon with it: the longest prefill
    /// `queued` on any rank, or this rank's queue plus the `own` prompt when
    /// that is longer. Queued tokens, like the `queue` scorer's: not weighted
    /// by `prefix_load_weight`.
    fn add_prefill_horizon(own: u64, ranks: usize, queued: impl Fn(usize) -> u64, costs: &mut [Slot]) {
        let longest = (0..ranks).map(&queued).max().unwrap_or(0);
        for (rank, cost) in costs.iter_mut().enumerate().take(ranks) {
            let horizon = longest.max(queued(rank).saturating_add(own));
            add_cost(cost, weighted(horizon, PREFILL_HORIZON_WEIGHT));
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
        // Nothing is queued: the prefill horizon is the prompt, x 0.5.
        assert_eq!(costs, vec![500 + 96 + 32, 500 + 66 + 32, 532, 532]);
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
        assert_eq!(scored(&new_prompt), vec![500 + 96 + 32, 500 + 66 + 32, 532, 532]);
        // Held on rank 2: as `rank`, each rank its own tokens.
        let index = IndexRecord::holding(2, &blocks.hash_chains(), 1_000_000);
        let mut held = prefix_request(&settings, blocks, 0);
        held.insert(0, Some((encode(&index), 1)));
        assert!(!held.held_nowhere());
        assert_eq!(scored(&held), vec![500, 480, 100, 0]);
    }

    /// A worker of two ranks holding 100 tokens each, reporting `running`
    /// requests and `waiting` uncached tokens per rank, scored for a 64-token
    /// prompt no rank holds under the lockstep rule (weight 1, capacity 1000).
    fn lockstep_costs(running: [u64; 2], waiting: [u64; 2]) -> Vec<Slot> {
        use crate::worker_state::RankFigures;
        let config = Config::from_json(
            br#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_load_weight":1,"prefix_load":"slowest_rank","prefix_queue":"polled","prefix_capacity_tokens":1000,"prefix_block_bytes":64}"#,
        )
        .unwrap();
        let mut s = state(&[100, 100], 1000);
        let figures: Vec<RankFigures> = (0..2)
            .map(|r| RankFigures {
                running_requests: Some(running[r]),
                waiting_uncached: Some(waiting[r]),
                ..Default::default()
            })
            .collect();
        s.apply_figures(s.snapshot_seq, &figures);
        let body = format!(r#"{{"text":"{}"}}"#, "p".repeat(256));
        let object = crate::body::JsonObject::parse(body.as_bytes()).unwrap();
        score_with_prefix(&config, PromptBlocks::of(&object, 64), &s, vec![0; 2])
    }

    #[test]
    fn the_lockstep_rule_counts_running_requests_toward_the_slowest_rank() {
        let idle = lockstep_costs([0, 0], [0, 0]);
        let busy = lockstep_costs([2, 0], [0, 0]);
        // Rank 0 running two requests is the slowest at 100 + 2 x 3,000: each
        // rank costs that; rank 1 does not raise it (100 + 64 + 3,000 for the
        // request itself stays below), rank 0 raises it by 3,064, slowed for
        // two ranks at 6.1 of capacity capped at 2: x 0.75 x 2 x 2.
        let slowest = 100 + 2 * RUNNING_REQUEST_TOKENS;
        let raised = 64 + RUNNING_REQUEST_TOKENS;
        assert_eq!(busy, vec![slowest + raised * 3 + 32, slowest + 32]);
        // Nothing running: tokens alone; each rank raises the slowest by 64,
        // at a tenth of capacity: x 0.75 x 2 x 0.1, rounded.
        assert_eq!(idle, vec![100 + 10 + 32; 2]);
    }

    #[test]
    fn the_lockstep_rule_costs_a_worker_its_longest_prefill_queue() {
        // Rank 0 has 1,000 uncached tokens waiting: its worker's prefill
        // horizon is 1,000 for rank 1 and 1,064 for rank 0 itself.
        let queued = lockstep_costs([0, 0], [1000, 0]);
        let empty = lockstep_costs([0, 0], [0, 0]);
        assert_eq!(queued[1] - empty[1], (1000 - 64) / 2);
        assert_eq!(queued[0] - queued[1], 64 / 2);
    }
}
