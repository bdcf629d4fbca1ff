//! Scorer `prefix` (prefix affinity): adds `prefix_uncached_weight` x the
//! prompt tokens the rank is thought not to hold in cache: the request's
//! own prefill there, from the worker's index as read before the choice.
//! When the prompt's deepest match is private (a conversation's own
//! history), the tokens a rank lacks of that match cost
//! `prefix_private_weight` instead (docs/prefix-affinity.md).

use crate::cost::{add_cost, weighted, Slot};
use crate::scheduler::{Context, Scorer, WorkerView};

pub struct Prefix;

impl Scorer for Prefix {
    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Slot]) {
        let Some(prefix) = ctx.prefix else {
            return;
        };
        let total = prefix.prompt.tokens();
        let weight = prefix.settings.uncached_weight;
        let extra = prefix.settings.private_weight - weight;
        let private = prefix.private_match().filter(|_| extra > 0.0);
        let cached = prefix.cached_ranks(worker.index);
        for (rank, cost) in costs.iter_mut().enumerate() {
            let held = cached.get(rank).copied().unwrap_or(0);
            add_cost(cost, weighted(total.saturating_sub(held), weight));
            if let Some(deepest) = private {
                add_cost(cost, weighted(deepest.saturating_sub(held), extra));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::JsonObject;
    use crate::codec::encode;
    use crate::config::Config;
    use crate::cost::REMOVED;
    use crate::prefix::index::IndexRecord;
    use crate::prefix::{PromptBlocks, RequestPrefix};
    use crate::scheduler::testing::*;
    use crate::scheduler::Constraint;

    #[test]
    fn adds_the_uncached_tokens_of_each_rank() {
        let config = Config::from_json(
            br#"{"workers":[{"address":"127.0.0.1:1","name":"a"}],"prefix_block_bytes":64,"prefix_uncached_weight":2}"#,
        )
        .unwrap();
        let settings = config.prefix.clone().unwrap();
        let body = format!(r#"{{"text":"{}"}}"#, "p".repeat(256));
        let object = JsonObject::parse(body.as_bytes()).unwrap();
        let blocks = PromptBlocks::of(&object, 64);
        // Rank 1 was sent the same prompt before.
        let index = IndexRecord::holding(1, &blocks.hash_chains(), 1_000_000);
        let mut prefix = prefix_request(&settings, blocks, 0);
        prefix.insert(0, Some((encode(&index), 7)));
        let w = worker("a", 1, None);
        let s = state(&[0, 0, 0], 1000);
        let view = WorkerView {
            index: 0,
            worker: &w,
            state: &s,
            loads: &[],
        };
        let with = Context {
            prefix: Some(&prefix),
            ..ctx(Constraint::default())
        };
        let mut costs = vec![5, 5, REMOVED];
        Prefix.score(&with, &view, &mut costs);
        // 256 bytes = 64 tokens, all held by rank 1: x2.
        assert_eq!(costs, vec![5 + 2 * 64, 5, REMOVED]);
        let unread = WorkerView { index: 1, ..view };
        let mut costs = vec![5];
        Prefix.score(&with, &unread, &mut costs);
        assert_eq!(costs, vec![5 + 2 * 64], "an index not read: nothing held");
        let mut without = vec![5];
        Prefix.score(&ctx(Constraint::default()), &view, &mut without);
        assert_eq!(without, vec![5], "no affinity, no cost");
    }

    #[test]
    fn leaving_a_private_match_costs_the_private_weight() {
        let config = Config::from_json(
            br#"{"workers":[{"address":"127.0.0.1:1","name":"a"}],"prefix_block_bytes":64,
                "prefix_uncached_weight":2,"prefix_private_weight":5}"#,
        )
        .unwrap();
        let settings = config.prefix.clone().unwrap();
        let history = format!(r#"{{"text":"{}"}}"#, "p".repeat(256));
        let held = PromptBlocks::of(&JsonObject::parse(history.as_bytes()).unwrap(), 64);
        let index = IndexRecord::holding(1, &held.hash_chains(), 1_000_000);
        // The next turn: the history (64 tokens) and 32 tokens more.
        let turn = format!(r#"{{"text":"{}{}"}}"#, "p".repeat(256), "q".repeat(128));
        let blocks = PromptBlocks::of(&JsonObject::parse(turn.as_bytes()).unwrap(), 64);
        let w = worker("a", 1, None);
        let s = state(&[0, 0], 1000);
        let view = WorkerView {
            index: 0,
            worker: &w,
            state: &s,
            loads: &[],
        };
        let cost_at = |now_ms: u64| {
            let mut prefix = RequestPrefix::new(&settings, blocks.clone(), true, 0, now_ms);
            prefix.insert(0, Some((encode(&index), 7)));
            let with = Context {
                prefix: Some(&prefix),
                ..ctx(Constraint::default())
            };
            let mut costs = vec![0, 0];
            Prefix.score(&with, &view, &mut costs);
            costs
        };
        // Routed 0.5 s ago (a shared prompt): every uncached token x2.
        assert_eq!(cost_at(1_000_500), vec![2 * 96, 2 * 32]);
        // Routed a minute ago (a conversation's own history): the 64 tokens
        // rank 0 lacks of it cost x5, the rest x2.
        assert_eq!(cost_at(1_060_000), vec![5 * 64 + 2 * 32, 2 * 32]);
    }
}
