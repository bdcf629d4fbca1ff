//! A model of smg's default policy, `cache_aware`, as smg runs it with
//! `--dp-aware` (docs/protocol.md, "What smg does differently"): each
//! (worker, rank) is a worker of its own; smg gets no loads, so it balances
//! on its own counts of requests in flight. Per (worker, rank) it keeps an
//! approximate tree of the request texts it sent there and:
//!
//! - when the in-flight counts are imbalanced (the busiest exceeds the mean
//!   by more than `--balance-abs-threshold` 64, capped at twice their
//!   standard deviation and never under 4, and by more than
//!   `--balance-rel-threshold` 1.5 times the mean), sends the request to the
//!   one with the fewest in flight;
//! - else to the one whose tree matches the longest prefix of the text, if
//!   the match covers more than `--cache-threshold` 0.3 of it; else to the
//!   one with the smallest tree.
//!
//! Texts are matched in 16-byte steps here (smg matches characters); trees
//! are not evicted (smg's `--max-tree-size` default is far above a run).
//! This is our model, built from that description, not smg's code.

use std::collections::HashSet;

use dprank::body::JsonObject;
use dprank::prefix::PromptBlocks;

use super::front::Placement;

const MATCH_BYTES: u32 = 16;
const CACHE_THRESHOLD: f64 = 0.3;
const BALANCE_ABS: f64 = 64.0;
const BALANCE_ABS_FLOOR: f64 = 4.0;
const BALANCE_REL: f64 = 1.5;

pub struct CacheAware {
    dp_size: usize,
    /// Per (worker, rank): the block hashes of the texts sent there.
    trees: Vec<HashSet<u32>>,
    /// Per (worker, rank): bytes of text inserted (the tree's size).
    sizes: Vec<u64>,
    in_flight: Vec<u64>,
}

impl CacheAware {
    pub fn new(workers: usize, dp_size: usize) -> CacheAware {
        let n = workers * dp_size;
        CacheAware {
            dp_size,
            trees: vec![HashSet::new(); n],
            sizes: vec![0; n],
            in_flight: vec![0; n],
        }
    }

    fn imbalanced(&self) -> bool {
        let n = self.in_flight.len().max(1) as f64;
        let loads: Vec<f64> = self.in_flight.iter().map(|l| *l as f64).collect();
        let mean = loads.iter().sum::<f64>() / n;
        let sd = (loads.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / n).sqrt();
        let max = loads.iter().copied().fold(0.0, f64::max);
        let abs = BALANCE_ABS.min(2.0 * sd).max(BALANCE_ABS_FLOOR);
        max - mean > abs && max > BALANCE_REL * mean
    }

    pub fn route(&mut self, body: &[u8]) -> Placement {
        let blocks = JsonObject::parse(body)
            .map(|o| PromptBlocks::of(&o, MATCH_BYTES))
            .unwrap_or_default();
        let chain: Vec<u32> = blocks
            .chains
            .first()
            .map(|c| c.hashes.clone())
            .unwrap_or_default();
        let text_len = blocks.tokens() * 4;
        let slot = if self.imbalanced() {
            argmin(&self.in_flight)
        } else {
            let matched: Vec<usize> = self
                .trees
                .iter()
                .map(|tree| chain.iter().take_while(|h| tree.contains(h)).count())
                .collect();
            let best = argmax(&matched);
            let rate = (matched[best] as u64 * u64::from(MATCH_BYTES)) as f64 / text_len.max(1) as f64;
            if rate > CACHE_THRESHOLD {
                best
            } else {
                argmin(&self.sizes)
            }
        };
        self.trees[slot].extend(chain.iter().copied());
        self.sizes[slot] += text_len;
        self.in_flight[slot] += 1;
        Placement {
            worker: slot / self.dp_size,
            rank: Some(slot % self.dp_size),
        }
    }

    pub fn done(&mut self, placement: Placement) {
        let slot = placement.worker * self.dp_size + placement.rank.unwrap_or(0);
        if let Some(count) = self.in_flight.get_mut(slot) {
            *count = count.saturating_sub(1);
        }
    }
}

/// Index of the smallest value (first of equals).
fn argmin(values: &[u64]) -> usize {
    values
        .iter()
        .enumerate()
        .min_by_key(|(_, v)| **v)
        .map_or(0, |(i, _)| i)
}

/// Index of the largest value (first of equals).
fn argmax(values: &[usize]) -> usize {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best
}
