//! A model of the Gateway API Inference Extension's endpoint picker (EPP)
//! with its default scheduling profile, in front of vLLM servers: one
//! endpoint per pod (server), never an engine inside it; the server's own
//! balancer then picks the engine. Read in kubernetes-sigs/
//! gateway-api-inference-extension (2025-2026): the Helm chart's default
//! profile (`config/charts/inferencepool/templates/epp-config.yaml`:
//! `queue-scorer` weight 2, `kv-cache-utilization-scorer` 2,
//! `prefix-cache-scorer` 3, then the max-score picker), the scorers
//! (`pkg/epp/scheduling/framework/plugins/scorer/queue.go`,
//! `kvcache_utilization.go`, `multi/prefix/plugin.go`), the metrics client
//! (`pkg/epp/backend/metrics/metrics.go`).
//!
//! - Queue: `(max - waiting) / (max - min)` over the pods, 1 when all equal.
//! - KV: `1 - KV usage`.
//! - Prefix: the prompt's bytes in blocks of 64 (at most 256 blocks; a
//!   prompt shorter than a block gives no score), chained hashes after one
//!   of the model name; a pod scores the blocks of the prompt its index
//!   holds, counted from the start while any pod holds the block, over the
//!   blocks hashed. The index is the EPP's own: the blocks of the prompts
//!   it routed to the pod, least recently used out beyond 31,250 per pod.
//! - The picker takes the highest weighted sum, ties at random.
//! - Metrics are polled every 50 ms. The metric mapping names
//!   `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` without an
//!   engine label, and of several samples the client keeps the one with
//!   the latest timestamp, the first when none has one: on a server with
//!   several engines it reads engine 0's (`Reading::FirstSample`, the
//!   default). `Reading::Sum` sums the waiting requests and averages the KV
//!   usage over the engines instead (a charitable reading).
//!
//! Not modelled: the saturation detector and flow control (they shed only
//! sheddable requests), LoRA affinity, metric staleness.

use std::collections::{BTreeSet, HashMap};

use dprank_sim::engine::EngineStats;

use super::choice::{mix, Placement};

/// The EPP's metrics refresh interval.
pub const POLL_S: f64 = 0.05;
const BLOCK_BYTES: usize = 64;
const MAX_BLOCKS: usize = 256;
const LRU_PER_POD: usize = 31_250;
const QUEUE_WEIGHT: f64 = 2.0;
const KV_WEIGHT: f64 = 2.0;
const PREFIX_WEIGHT: f64 = 3.0;

/// How a pod's per-engine samples become one figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// The first sample of each series (engine 0), as the EPP reads them.
    FirstSample,
    /// Waiting summed, KV usage averaged over the engines.
    Sum,
}

/// One pod's approximate prefix index: block hashes, least recently used
/// out first.
#[derive(Debug, Default)]
struct Lru {
    used: HashMap<u64, u64>,
    order: BTreeSet<(u64, u64)>,
    tick: u64,
}

impl Lru {
    fn contains(&self, hash: u64) -> bool {
        self.used.contains_key(&hash)
    }

    fn add(&mut self, hash: u64) {
        self.tick += 1;
        if let Some(old) = self.used.insert(hash, self.tick) {
            self.order.remove(&(old, hash));
        }
        self.order.insert((self.tick, hash));
        while self.used.len() > LRU_PER_POD {
            let Some((tick, oldest)) = self.order.pop_first() else {
                break;
            };
            if self.used.get(&oldest) == Some(&tick) {
                self.used.remove(&oldest);
            }
        }
    }
}

/// One EPP (one gateway).
pub struct Gie {
    reading: Reading,
    /// (waiting, KV usage) per pod, as last polled.
    metrics: Vec<(f64, f64)>,
    index: Vec<Lru>,
    model: String,
    draws: u64,
}

fn hash_bytes(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = seed ^ 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        h = (h ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(h)
}

impl Gie {
    pub fn new(pods: usize, reading: Reading, model: &str, seed: u64) -> Gie {
        Gie {
            reading,
            metrics: vec![(0.0, 0.0); pods],
            index: (0..pods).map(|_| Lru::default()).collect(),
            model: model.to_string(),
            draws: seed,
        }
    }

    /// A poll of pod `pod`'s `/metrics`: what its engines last reported.
    pub fn poll(&mut self, pod: usize, engines: &[EngineStats]) {
        let Some(slot) = self.metrics.get_mut(pod) else {
            return;
        };
        *slot = match self.reading {
            Reading::FirstSample => engines
                .first()
                .map_or((0.0, 0.0), |e| (e.waiting as f64, e.kv_usage)),
            Reading::Sum => {
                let waiting: u64 = engines.iter().map(|e| e.waiting).sum();
                let kv = engines.iter().map(|e| e.kv_usage).sum::<f64>() / engines.len().max(1) as f64;
                (waiting as f64, kv)
            }
        };
    }

    /// The prompt's block hashes, the model's first.
    fn hashes(&self, prompt: &[u8]) -> Vec<u64> {
        if prompt.len() < BLOCK_BYTES {
            return Vec::new();
        }
        let prompt = &prompt[..prompt.len().min(BLOCK_BYTES * MAX_BLOCKS)];
        let mut hashes = vec![hash_bytes(0, self.model.as_bytes())];
        for block in prompt.chunks_exact(BLOCK_BYTES) {
            let parent = hashes[hashes.len() - 1];
            hashes.push(hash_bytes(parent, block));
        }
        hashes
    }

    /// Picks the pod for a request whose prompt text is `prompt`, and
    /// records its blocks in that pod's index.
    pub fn route(&mut self, prompt: &[u8]) -> Placement {
        let pods = self.metrics.len().max(1);
        let hashes = self.hashes(prompt);
        let mut matched = vec![0usize; pods];
        for hash in &hashes {
            let mut any = false;
            for (pod, index) in self.index.iter().enumerate() {
                if index.contains(*hash) {
                    matched[pod] += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        let min = self.metrics.iter().map(|m| m.0).fold(f64::INFINITY, f64::min);
        let max = self.metrics.iter().map(|m| m.0).fold(f64::NEG_INFINITY, f64::max);
        let scores: Vec<f64> = (0..pods)
            .map(|pod| {
                let (waiting, kv) = self.metrics.get(pod).copied().unwrap_or_default();
                let queue = if max == min {
                    1.0
                } else {
                    (max - waiting) / (max - min)
                };
                let prefix = if hashes.is_empty() {
                    0.0
                } else {
                    matched[pod] as f64 / hashes.len() as f64
                };
                QUEUE_WEIGHT * queue + KV_WEIGHT * (1.0 - kv) + PREFIX_WEIGHT * prefix
            })
            .collect();
        let best = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let tied: Vec<usize> = (0..pods).filter(|pod| scores[*pod] >= best - 1e-12).collect();
        self.draws = self.draws.wrapping_add(1);
        let worker = tied[(mix(self.draws) % tied.len() as u64) as usize];
        if let Some(index) = self.index.get_mut(worker) {
            for hash in &hashes {
                index.add(*hash);
            }
        }
        Placement {
            worker,
            rank: None,
            rank_header: None,
            priority: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(waiting: u64, kv: f64) -> EngineStats {
        EngineStats {
            waiting,
            kv_usage: kv,
            ..EngineStats::default()
        }
    }

    #[test]
    fn a_routed_prompt_draws_its_prefix_back_to_the_same_pod() {
        let mut gie = Gie::new(4, Reading::FirstSample, "m", 7);
        let system = "You are a helpful assistant. ".repeat(20);
        let first = gie.route(format!("{system}question one").as_bytes()).worker;
        for i in 0..5 {
            let again = gie.route(format!("{system}question {i}").as_bytes()).worker;
            assert_eq!(again, first);
        }
        // A short prompt has no blocks: only the loads decide.
        gie.poll(0, &[stats(5, 0.5)]);
        gie.poll(1, &[stats(0, 0.1)]);
        gie.poll(2, &[stats(5, 0.5)]);
        gie.poll(3, &[stats(5, 0.5)]);
        assert_eq!(gie.route(b"hi").worker, 1);
    }

    #[test]
    fn the_first_sample_is_engine_0_and_sum_reads_them_all() {
        let engines = [stats(0, 0.0), stats(9, 0.9)];
        let mut first = Gie::new(1, Reading::FirstSample, "m", 0);
        first.poll(0, &engines);
        assert_eq!(first.metrics[0], (0.0, 0.0));
        let mut sum = Gie::new(1, Reading::Sum, "m", 0);
        sum.poll(0, &engines);
        assert_eq!(sum.metrics[0], (9.0, 0.45));
    }

    #[test]
    fn the_index_forgets_least_recently_used_blocks_beyond_its_capacity() {
        let mut lru = Lru::default();
        for hash in 0..(LRU_PER_POD as u64 + 10) {
            lru.add(hash);
        }
        assert!(!lru.contains(0) && lru.contains(10) && lru.contains(LRU_PER_POD as u64 + 9));
    }
}
