//! Scorer `rendezvous` (prefix affinity, `gateways` > 1): adds to each rank a
//! share of the prompt tokens it is thought not to hold, the share drawn
//! from a hash of the prompt's first block and the (worker, rank). Every
//! gateway computes the same shares, so gateways that have never seen a
//! prefix lean toward the same ranks for it instead of each placing it on
//! its own; a rank this gateway's index says holds the prompt pays less.

use crate::cost::{add_cost, Slot};
use crate::scheduler::pickers::least_cost::mix;
use crate::scheduler::{Context, Scorer, WorkerView};
use std::net::{IpAddr, SocketAddr};

/// The share's resolution: a rank pays `uncached x h / SHARES`, `h` in 0..SHARES.
const SHARES: u64 = 1024;

pub struct Rendezvous;

impl Scorer for Rendezvous {
    /// Only gateways that share a fleet need to lean alike.
    fn applies(&self, ctx: &Context) -> bool {
        ctx.prefix.is_some() && ctx.gateways > 1
    }

    fn score(&self, ctx: &Context, worker: &WorkerView, costs: &mut [Slot]) {
        let Some(prefix) = ctx.prefix else { return };
        if ctx.gateways <= 1 {
            return;
        }
        let Some(head) = prefix.prompt.chains.first().and_then(|c| c.hashes.first()) else {
            return;
        };
        let total = prefix.prompt.tokens();
        let seed = u64::from(*head) ^ endpoint_key(&worker.worker.address);
        for (rank, cost) in costs.iter_mut().enumerate() {
            let uncached = total.saturating_sub(prefix.cached(worker.index, rank));
            let share = mix(seed, rank as u64 + 1) % SHARES;
            add_cost(cost, uncached.saturating_mul(share) / SHARES);
        }
    }
}

/// The same number for a worker on every gateway (its address, not its
/// place in a membership list).
fn endpoint_key(address: &SocketAddr) -> u64 {
    let ip = match address.ip() {
        IpAddr::V4(v4) => u64::from(u32::from(v4)),
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            (bits as u64) ^ ((bits >> 64) as u64)
        }
    };
    mix(ip, u64::from(address.port()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::JsonObject;
    use crate::config::Config;
    use crate::prefix::PromptBlocks;
    use crate::scheduler::testing::*;
    use crate::scheduler::{Constraint, LoadTable, WorkerView};

    fn scored(gateways: u32, text: &str, port: u16) -> Vec<Slot> {
        let config = Config::from_json(br#"{"workers":[{"address":"127.0.0.1:1","name":"a"}]}"#).unwrap();
        let settings = config.prefix.clone().unwrap();
        let body = format!(r#"{{"text":"{text}"}}"#);
        let object = JsonObject::parse(body.as_bytes()).unwrap();
        let prompt = PromptBlocks::of(&object, settings.block_bytes);
        let prefix = prefix_request(&settings, prompt, 0);
        let w = worker("a", port, None);
        let s = state(&[0; 8], 1000);
        let loads = LoadTable::of(std::slice::from_ref(&Some(s.clone())));
        let view = WorkerView {
            index: 0,
            worker: &w,
            state: &s,
            loads: loads.worker(0),
        };
        let ctx = Context {
            prefix: Some(&prefix),
            gateways,
            ..ctx(Constraint::default())
        };
        let mut costs = vec![0; 8];
        Rendezvous.score(&ctx, &view, &mut costs);
        costs
    }

    #[test]
    fn every_gateway_leans_the_same_way_per_prompt() {
        let long = "x".repeat(4000);
        let a = scored(4, &long, 1);
        assert_eq!(a, scored(4, &long, 1), "the same on every gateway");
        let top = a.iter().max().copied().unwrap_or(0);
        assert!(top > 0 && top <= 1000, "at most the uncached tokens: {a:?}");
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 4,
            "ranks differ: {a:?}"
        );
        assert_ne!(a, scored(4, &"y".repeat(4000), 1), "another prompt, another lean");
        assert_ne!(a, scored(4, &long, 2), "another worker, another lean");
        assert_eq!(scored(1, &long, 1), vec![0; 8], "one gateway: nothing");
    }
}
