//! Scorer `lockstep` (prefix affinity, where `prefix_load` says: always
//! under `slowest_rank`, for a prompt no rank holds under
//! `slowest_rank_when_uncached`, SGLang's default): under DP attention a
//! worker's ranks step together, so a rank is costed by its worker's slowest
//! rank and what the request raises it by, and by its worker's longest
//! prefill queue. It stands in for the `load` scorer (which then does not
//! apply); its terms are the prefix settings' `lockstep`
//! (`config/prefix.rs`, docs/prefix-affinity.md).

use super::load::remove_unlisted;
use crate::config::prefix::{Lockstep as Terms, DEFAULT_CAPACITY_TOKENS};
use crate::cost::{add_cost, weighted, Slot, REMOVED};
use crate::scheduler::{Context, Scorer, WorkerView};

pub struct Lockstep;

impl Scorer for Lockstep {
    fn applies(&self, ctx: &Context) -> bool {
        ctx.prefix
            .is_some_and(|p| p.settings.load.lockstep(p.held_nowhere()))
    }

    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Slot]) {
        let Some(prefix) = ctx.prefix else {
            return;
        };
        let settings = prefix.settings;
        let terms = &settings.lockstep;
        let capacity = settings
            .capacity_tokens
            .or(worker.state.prefill.capacity(0))
            .unwrap_or(DEFAULT_CAPACITY_TOKENS);
        let own = prefix.prompt.tokens();
        let running = |rank: usize| {
            terms
                .running_tokens
                .saturating_mul(worker.state.prefill.running(rank).unwrap_or(0))
        };
        add_slowest(
            terms,
            settings.load_weight,
            own,
            capacity,
            worker.loads,
            running,
            costs,
        );
        add_rank_order(
            terms.rank_weight * settings.load_weight,
            worker.loads,
            running,
            costs,
        );
        let queued = |rank: usize| worker.state.prefill.queued(rank, settings.queue).tokens;
        add_prefill_horizon(terms, own, worker.loads.len(), queued, costs);
        remove_unlisted(worker, costs);
    }
}

/// Each rank costs its worker's slowest rank's load (its tokens plus
/// `running_tokens` per running request, `running`), x `weight`; a rank the
/// request's `own` tokens (and one more request) would make the most loaded
/// also costs what it raises that rank by, once for every rank it slows, in
/// proportion to how full the slowest rank is (of `capacity` tokens, at most
/// `max_fullness`) and `raise_weight`.
fn add_slowest(
    terms: &Terms,
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
    let fullness = (slowest as f64 / capacity.max(1) as f64).min(terms.max_fullness);
    let per_raised = terms.raise_weight * loads.len() as f64 * fullness;
    // The request runs too, where the worker reports running requests.
    let own = match (0..loads.len()).any(|rank| running(rank) > 0) {
        true => own.saturating_add(terms.running_tokens),
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

/// Within a worker, which the rest of the rule costs alike rank for rank,
/// its most loaded rank (`running` included) costs `weight` times its load
/// above the worker's least loaded rank: it is never chosen while another
/// rank has room, and the others still tie (a draw spreads requests among
/// them). The other ranks' costs are unchanged, so workers compare as
/// before unless only their slowest rank could win.
fn add_rank_order(weight: f64, loads: &[Slot], running: impl Fn(usize) -> u64, costs: &mut [Slot]) {
    if weight == 0.0 {
        return;
    }
    let lockstep = |rank: usize, load: Slot| load.saturating_add(running(rank));
    let listed = || {
        loads
            .iter()
            .enumerate()
            .filter(|(_, l)| **l != REMOVED)
            .map(|(rank, l)| (rank, lockstep(rank, *l)))
    };
    let (Some(least), Some(most)) = (listed().map(|(_, l)| l).min(), listed().map(|(_, l)| l).max()) else {
        return;
    };
    for (rank, load) in listed().filter(|(_, l)| *l == most && most > least) {
        if let Some(cost) = costs.get_mut(rank) {
            add_cost(cost, weighted(load - least, weight));
        }
    }
}

/// A rank's prefill steps stall every rank of its worker, so the request
/// costs `horizon_weight` times the worker's prefill horizon with it: the
/// longest prefill `queued` on any rank, or this rank's queue plus the `own`
/// prompt when that is longer. Queued tokens, like the `queue` scorer's: not
/// weighted by `prefix_load_weight`.
fn add_prefill_horizon(
    terms: &Terms,
    own: u64,
    ranks: usize,
    queued: impl Fn(usize) -> u64,
    costs: &mut [Slot],
) {
    let longest = (0..ranks).map(&queued).max().unwrap_or(0);
    for (rank, cost) in costs.iter_mut().enumerate().take(ranks) {
        let horizon = longest.max(queued(rank).saturating_add(own));
        add_cost(cost, weighted(horizon, terms.horizon_weight));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, LoadMeasure};
    use crate::prefix::{PromptBlocks, RequestPrefix};
    use crate::scheduler::profile::ScorerStep;
    use crate::scheduler::testing::*;
    use crate::scheduler::Constraint;
    use crate::worker_state::{RankFigures, WorkerState};

    /// `state`'s costs (worker 0) for `prefix`, scored by whichever of `load`
    /// and `lockstep` applies, as a choice runs them.
    fn scored(prefix: &RequestPrefix, state: &WorkerState, mut costs: Vec<Slot>) -> Vec<Slot> {
        let w = worker("a", 1, None);
        let loads = crate::scheduler::LoadTable::of(std::slice::from_ref(&Some(state.clone())));
        let view = WorkerView {
            index: 0,
            worker: &w,
            state,
            loads: loads.worker(0),
        };
        let ctx = Context {
            prefix: Some(prefix),
            ..ctx(Constraint::default())
        };
        let steps = [ScorerStep::Load, ScorerStep::Lockstep];
        let applying: Vec<_> = steps.iter().filter(|s| s.applies(&ctx)).collect();
        assert_eq!(applying.len(), 1, "load or lockstep, never both");
        for step in applying {
            step.score(&ctx, &view, &mut costs);
        }
        costs
    }

    /// A prompt of `bytes` bytes, in blocks of 64 bytes (16 tokens).
    fn prompt(bytes: usize) -> PromptBlocks {
        let body = format!(r#"{{"text":"{}"}}"#, "p".repeat(bytes));
        PromptBlocks::of(&crate::body::JsonObject::parse(body.as_bytes()).unwrap(), 64)
    }

    /// The rule's terms without the rank order (its own test below), unless `keys` set it.
    fn config(keys: &str) -> Config {
        let order = match keys.contains("prefix_lockstep_rank_weight") {
            true => "",
            false => r#","prefix_lockstep_rank_weight":0"#,
        };
        let json = format!(
            r#"{{"workers":[{{"address":"127.0.0.1:1"}}],"prefix_load_weight":1,"prefix_capacity_tokens":1000,"prefix_block_bytes":64{keys}{order}}}"#
        );
        Config::from_json(json.as_bytes()).unwrap()
    }

    #[test]
    fn within_a_worker_the_slowest_rank_is_never_chosen_while_another_has_room() {
        // The issue's worker: 5,000 / 150 / 3,000 / 4,000 tokens, a short
        // prompt no rank holds, capacity 100,000 (the raise rounds to little).
        let settings = big(r#","prefix_lockstep_rank_weight":0.05"#);
        let s = state(&[5000, 150, 3000, 4000], 1000);
        let costs = scored(&prefix_request(&settings, prompt(64), 0), &s, vec![0; 4]);
        // Without it the ranks nearly tie: the slowest could be drawn.
        let plain = config_plain();
        let flat = scored(&prefix_request(&plain, prompt(64), 0), &s, vec![0; 4]);
        assert!(flat[1..].iter().all(|c| *c == flat[1]), "{flat:?}");
        // The least loaded rank costs what it did: workers compare as before.
        assert_eq!(costs[1], flat[1]);
    }

    fn config_plain() -> crate::config::Prefix {
        big(r#","prefix_lockstep_rank_weight":0"#)
    }

    /// Prefix settings with a capacity of 100,000 tokens a rank.
    fn big(keys: &str) -> crate::config::Prefix {
        let json = format!(
            r#"{{"workers":[{{"address":"127.0.0.1:1"}}],"prefix_load_weight":1,"prefix_capacity_tokens":100000,"prefix_block_bytes":64{keys}}}"#
        );
        Config::from_json(json.as_bytes()).unwrap().prefix.unwrap()
    }

    #[test]
    fn slowest_rank_costs_the_worker_s_slowest_and_what_a_request_raises_it_by() {
        // Capacity 1000 tokens; a 256-byte prompt is 64 tokens.
        let config = config(r#","prefix_load":"slowest_rank""#);
        let settings = config.prefix.clone().unwrap();
        let s = state(&[500, 480, 100, 0], 1000);
        let costs = scored(&prefix_request(&settings, prompt(256), 0), &s, vec![0; 4]);
        // Every rank costs the slowest (500). Rank 0 would rise by 64,
        // rank 1 by 44, slowed for 4 ranks at half full: x 0.75 x 4 x 0.5.
        // Nothing is queued: the prefill horizon is the prompt, x 0.5.
        assert_eq!(costs, vec![500 + 96 + 32, 500 + 66 + 32, 532, 532]);
        assert_eq!(settings.load, LoadMeasure::SlowestRank);
        // A rank without a figure, and one the state does not list: removed.
        let mut s = WorkerState::default();
        let seq = s.begin_poll();
        s.apply_snapshot(seq, 1000, &[None, Some(100)]);
        let costs = scored(&prefix_request(&settings, prompt(256), 0), &s, vec![0; 3]);
        assert_eq!(costs, vec![REMOVED, 100 + 10 + 32, REMOVED]);
    }

    #[test]
    fn slowest_rank_when_uncached_costs_by_the_slowest_only_a_prompt_no_rank_holds() {
        use crate::codec::encode;
        use crate::prefix::index::IndexRecord;
        let config = config(r#","prefix_load":"slowest_rank_when_uncached""#);
        let settings = config.prefix.clone().unwrap();
        let blocks = prompt(256);
        let s = state(&[500, 480, 100, 0], 1000);
        // Held nowhere: as `slowest_rank` (the test above).
        let new_prompt = prefix_request(&settings, blocks.clone(), 0);
        assert_eq!(
            scored(&new_prompt, &s, vec![0; 4]),
            vec![500 + 96 + 32, 500 + 66 + 32, 532, 532]
        );
        // Held on rank 2: as `rank`, each rank its own tokens (the `load` scorer).
        let index = IndexRecord::holding(2, &blocks.hash_chains(), 1_000_000);
        let mut held = prefix_request(&settings, blocks, 0);
        held.insert(0, Some((encode(&index), 1)));
        assert!(!held.held_nowhere());
        assert_eq!(scored(&held, &s, vec![0; 4]), vec![500, 480, 100, 0]);
    }

    /// A worker of two ranks holding 100 tokens each, reporting `running`
    /// requests and `waiting` uncached tokens per rank, scored for a 64-token
    /// prompt no rank holds under the lockstep rule (weight 1, capacity
    /// 1000), its terms as `keys` set them.
    fn lockstep_costs(keys: &str, running: [u64; 2], waiting: [u64; 2]) -> Vec<Slot> {
        let config = config(&format!(
            r#","prefix_load":"slowest_rank","prefix_queue":"polled"{keys}"#
        ));
        let settings = config.prefix.clone().unwrap();
        let mut s = state(&[100, 100], 1000);
        let figures: Vec<RankFigures> = (0..2)
            .map(|r| RankFigures {
                running_requests: Some(running[r]),
                waiting_uncached: Some(waiting[r]),
                ..Default::default()
            })
            .collect();
        s.apply_figures(s.snapshot_seq, &figures);
        scored(&prefix_request(&settings, prompt(256), 0), &s, vec![0; 2])
    }

    #[test]
    fn the_lockstep_rule_counts_running_requests_toward_the_slowest_rank() {
        let running_tokens = Terms::default().running_tokens;
        assert_eq!(running_tokens, 3_000);
        let idle = lockstep_costs("", [0, 0], [0, 0]);
        let busy = lockstep_costs("", [2, 0], [0, 0]);
        // Rank 0 running two requests is the slowest at 100 + 2 x 3,000: each
        // rank costs that; rank 1 does not raise it (100 + 64 + 3,000 for the
        // request itself stays below), rank 0 raises it by 3,064, slowed for
        // two ranks at 6.1 of capacity capped at 2: x 0.75 x 2 x 2.
        let slowest = 100 + 2 * running_tokens;
        let raised = 64 + running_tokens;
        assert_eq!(busy, vec![slowest + raised * 3 + 32, slowest + 32]);
        // Nothing running: tokens alone; each rank raises the slowest by 64,
        // at a tenth of capacity: x 0.75 x 2 x 0.1, rounded.
        assert_eq!(idle, vec![100 + 10 + 32; 2]);
    }

    #[test]
    fn the_lockstep_rule_costs_a_worker_its_longest_prefill_queue() {
        // Rank 0 has 1,000 uncached tokens waiting: its worker's prefill
        // horizon is 1,000 for rank 1 and 1,064 for rank 0 itself.
        let queued = lockstep_costs("", [0, 0], [1000, 0]);
        let empty = lockstep_costs("", [0, 0], [0, 0]);
        assert_eq!(queued[1] - empty[1], (1000 - 64) / 2);
        assert_eq!(queued[0] - queued[1], 64 / 2);
    }

    #[test]
    fn the_terms_are_the_configured_ones() {
        let keys = r#","prefix_lockstep_raise_weight":1.5,"prefix_lockstep_max_fullness":1,"prefix_lockstep_running_tokens":1000,"prefix_lockstep_horizon_weight":0.25"#;
        // Rank 0 running two requests is the slowest at 100 + 2 x 1,000; it
        // raises it by 64 + 1,000, slowed for two ranks at full (2.1 of
        // capacity capped at 1): x 1.5 x 2 x 1. The horizon is the prompt,
        // x 0.25.
        assert_eq!(
            lockstep_costs(keys, [2, 0], [0, 0]),
            vec![2100 + 1064 * 3 + 16, 2100 + 16]
        );
    }
}
