//! Scorer `kv` (prefix affinity): adds `prefix_kv_weight` x the KV the
//! request would lack on the rank: its uncached prompt and output budget
//! beyond the rank's free KV (polled capacity - tokens in use - estimates of
//! requests sent since the poll). A full rank admits a request only as
//! running ones finish, which its queued prefill does not show.

use crate::cost::{add_cost, weighted, Slot};
use crate::scheduler::{Context, Scorer, WorkerView};

pub struct Kv;

impl Scorer for Kv {
    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Slot]) {
        let Some(prefix) = ctx.prefix else {
            return;
        };
        let weight = prefix.settings.kv_weight;
        if weight == 0.0 {
            return;
        }
        let state = worker.state;
        let prompt = prefix.prompt.tokens();
        for (rank, cost) in costs.iter_mut().enumerate() {
            let (Some(capacity), Some(used)) = (state.prefill.capacity(rank), state.prefill.used(rank))
            else {
                continue;
            };
            let free = capacity
                .saturating_sub(used)
                .saturating_sub(state.pending_tokens(rank));
            let need = prompt
                .saturating_sub(prefix.cached(worker.index, rank))
                .saturating_add(prefix.output);
            add_cost(cost, weighted(need.saturating_sub(free), weight));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::JsonObject;
    use crate::config::Config;
    use crate::prefix::PromptBlocks;
    use crate::scheduler::testing::*;
    use crate::scheduler::Constraint;
    use crate::worker_state::RankFigures;

    #[test]
    fn adds_the_kv_a_full_rank_lacks() {
        let config =
            Config::from_json(br#"{"workers":[{"address":"127.0.0.1:1"}],"prefix_kv_weight":2}"#).unwrap();
        let settings = config.prefix.clone().unwrap();
        let body = format!(r#"{{"text":"{}"}}"#, "k".repeat(800)); // 200 tokens
        let prompt = PromptBlocks::of(&JsonObject::parse(body.as_bytes()).unwrap(), 512);
        let prefix = prefix_request(&settings, prompt, 100);
        let w = worker("a", 1, None);
        let mut s = state(&[0, 0, 0], 1000);
        let figures = |used| RankFigures {
            used: Some(used),
            capacity: Some(1000),
            ..Default::default()
        };
        s.apply_figures(
            s.snapshot_seq,
            &[figures(900), figures(100), RankFigures::default()],
        );
        s.add(0, 1, 650);
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
        let mut costs = vec![1, 1, 1];
        Kv.score(&ctx, &view, &mut costs);
        // Rank 0: needs 300, 100 free. Rank 1: 900 - 650 sent since = 250 free.
        // Rank 2 reports no capacity: not judged.
        assert_eq!(costs, vec![1 + 2 * 200, 1 + 2 * 50, 1]);
    }
}
