//! Scorer `prefix` (prefix affinity): adds `prefix_uncached_weight` x the
//! prompt tokens the rank is thought not to hold in cache: the request's
//! own prefill there. The worker's index is read here, once per request.

use super::{Context, Scorer, WorkerView};
use crate::cost::Slot;

pub struct Prefix;

impl Scorer for Prefix {
    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Slot]) {
        if let Some(affinity) = ctx.affinity {
            affinity.add_uncached(worker.index, costs);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::{Constraint, REMOVED};
    use super::*;
    use crate::body::JsonObject;
    use crate::config::Config;
    use crate::host::fake::FakeHost;
    use crate::prefix::PromptBlocks;

    #[test]
    fn adds_the_uncached_tokens_of_each_rank() {
        let config = Config::from_json(
            br#"{"workers":[{"address":"127.0.0.1:1","name":"a"}],"prefix_block_bytes":64,"prefix_uncached_weight":2}"#,
        )
        .unwrap();
        let settings = config.prefix.clone().unwrap();
        let h = FakeHost::default();
        h.now.set(1_000_000);
        let body = format!(r#"{{"text":"{}"}}"#, "p".repeat(256));
        let object = JsonObject::parse(body.as_bytes()).unwrap();
        let blocks = || PromptBlocks::of(&object, 64);
        // Rank 1 was sent the same prompt before (into the index a poll created).
        crate::store::create_index(&config, &h, 0);
        prefix_affinity(&config, &settings, &h, blocks(), 0).record(0, 1, None);
        let affinity = prefix_affinity(&config, &settings, &h, blocks(), 0);
        let w = worker("a", 1, None);
        let s = state(&[0, 0, 0], 1000);
        let view = WorkerView {
            index: 0,
            worker: &w,
            state: &s,
            loads: &[],
        };
        let with = Context {
            affinity: Some(&affinity),
            ..ctx(Constraint::default())
        };
        let mut costs = vec![5, 5, REMOVED];
        let reads = h.host_calls("shared_get");
        Prefix.score(&with, &view, &mut costs);
        Prefix.score(&with, &view, &mut costs);
        assert_eq!(
            h.host_calls("shared_get") - reads,
            1,
            "one read per worker and request"
        );
        // 256 bytes = 64 tokens, all held by rank 1: x2, twice.
        assert_eq!(costs, vec![5 + 2 * 2 * 64, 5, REMOVED]);
        let mut without = vec![5];
        Prefix.score(&ctx(Constraint::default()), &view, &mut without);
        assert_eq!(without, vec![5], "no affinity, no cost");
    }
}
