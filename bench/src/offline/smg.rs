//! A model of smg's default policy, `cache_aware` (docs/protocol.md, "What
//! smg does differently"), with its knobs, run two ways:
//!
//! - with `--dp-aware`, each (worker, rank) is a target of its own and smg
//!   injects the rank; smg polls no loads then, so it balances on its own
//!   counts of requests in flight;
//! - without, the targets are the workers and each worker's own controller
//!   picks the rank (the variant's `dispatch`).
//!
//! Per target it keeps an approximate tree of the request texts it sent
//! there and:
//!
//! - when the in-flight counts are imbalanced (the busiest exceeds the mean
//!   by more than `--balance-abs-threshold`, that margin capped at twice
//!   their standard deviation and never under 4 unless the threshold is
//!   lower, and exceeds `--balance-rel-threshold` times the mean), sends the
//!   request to the one with the fewest in flight;
//! - else to the one whose tree matches the longest prefix of the text, if
//!   the match covers more than `--cache-threshold` of it; else to the one
//!   with the smallest tree.
//!
//! Texts are matched in 16-byte steps here (smg matches characters); trees
//! are not evicted (smg's `--max-tree-size` default is far above a run).
//! This is our model, built from that description and smg 1.13's `--help`,
//! not smg's code: tables label it a model.
//!
//! With `--max-concurrent-requests N` the model also limits what is in
//! flight (a permit per request, held until its answer ends, as 1.13's
//! `--help` says): beyond N a request waits in a first-come queue of
//! `--queue-size` (default 100; a full queue answers 429) for at most
//! `--queue-timeout-secs` (default 60; then 408).

use std::collections::{HashSet, VecDeque};

use dprank::body::JsonObject;
use dprank::prefix::PromptBlocks;

use super::choice::Placement;

const MATCH_BYTES: u32 = 16;
const BALANCE_ABS_FLOOR: f64 = 4.0;

/// smg's `cache_aware` knobs and its concurrency limiter (its 1.13
/// defaults unless the variant sets them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SmgKnobs {
    pub cache_threshold: f64,
    pub balance_abs: f64,
    pub balance_rel: f64,
    /// `--max-concurrent-requests` (None: no limit, as its default bound of
    /// thousands is here).
    pub max_concurrent: Option<usize>,
    pub queue_size: usize,
    pub queue_timeout_s: f64,
}

impl Default for SmgKnobs {
    fn default() -> Self {
        SmgKnobs {
            cache_threshold: 0.3,
            balance_abs: 64.0,
            balance_rel: 1.5,
            max_concurrent: None,
            queue_size: 100,
            queue_timeout_s: 60.0,
        }
    }
}

impl SmgKnobs {
    /// The knobs among smg flags (`--cache-threshold 0.5`, ...); flags the
    /// model has no part for are refused, so a variant never runs here as
    /// something it is not.
    pub fn from_args(args: &[String]) -> Result<SmgKnobs, String> {
        let mut knobs = SmgKnobs::default();
        let mut i = 0;
        while i < args.len() {
            let flag = args[i].as_str();
            let value = || -> Result<f64, String> {
                args.get(i + 1)
                    .and_then(|v| v.parse::<f64>().ok())
                    .ok_or_else(|| format!("smg flag {flag} needs a number"))
            };
            match flag {
                "--cache-threshold" | "--cache-match-threshold" => knobs.cache_threshold = value()?,
                "--balance-abs-threshold" | "--spill-abs-threshold" => knobs.balance_abs = value()?,
                "--balance-rel-threshold" | "--spill-rel-threshold" => knobs.balance_rel = value()?,
                "--max-concurrent-requests" => {
                    let n = value()?;
                    knobs.max_concurrent = (n > 0.0).then_some(n as usize);
                }
                "--queue-size" => knobs.queue_size = value()? as usize,
                "--queue-timeout-secs" => knobs.queue_timeout_s = value()?,
                other => return Err(format!("the offline model of smg has no part for `{other}`")),
            }
            i += 2;
        }
        Ok(knobs)
    }
}

pub struct CacheAware {
    /// Ranks per worker when targets are (worker, rank); None: targets are workers.
    dp_size: Option<usize>,
    knobs: SmgKnobs,
    /// Per target: the block hashes of the texts sent there.
    trees: Vec<HashSet<u32>>,
    /// Per target: bytes of text inserted (the tree's size).
    sizes: Vec<u64>,
    in_flight: Vec<u64>,
}

impl CacheAware {
    pub fn new(workers: usize, dp_size: usize, dp_aware: bool, knobs: &SmgKnobs) -> CacheAware {
        let n = if dp_aware { workers * dp_size } else { workers };
        CacheAware {
            dp_size: dp_aware.then_some(dp_size),
            knobs: *knobs,
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
        let floor = BALANCE_ABS_FLOOR.min(self.knobs.balance_abs);
        let abs = self.knobs.balance_abs.min(2.0 * sd).max(floor);
        max - mean > abs && max > self.knobs.balance_rel * mean
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
            if rate > self.knobs.cache_threshold {
                best
            } else {
                argmin(&self.sizes)
            }
        };
        self.trees[slot].extend(chain.iter().copied());
        self.sizes[slot] += text_len;
        self.in_flight[slot] += 1;
        match self.dp_size {
            Some(dp) => Placement {
                worker: slot / dp,
                rank: Some(slot % dp),
                rank_header: None,
                priority: None,
            },
            None => Placement {
                worker: slot,
                rank: None,
                rank_header: None,
                priority: None,
            },
        }
    }

    pub fn done(&mut self, placement: Placement) {
        let slot = match self.dp_size {
            Some(dp) => placement.worker * dp + placement.rank.unwrap_or(0),
            None => placement.worker,
        };
        if let Some(count) = self.in_flight.get_mut(slot) {
            *count = count.saturating_sub(1);
        }
    }
}

/// A request waiting for a permit.
struct Queued {
    id: u64,
    at_s: f64,
    body: Vec<u8>,
}

/// A waiting request's end: its body, now in flight; or refused (status, when).
pub type Settled = Result<Vec<u8>, (u16, f64)>;

/// smg's concurrency limiter and its queue.
pub struct Limiter {
    max: usize,
    queue_size: usize,
    timeout_s: f64,
    in_flight: usize,
    queue: VecDeque<Queued>,
}

/// What the limiter does with a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Permit {
    /// In flight now.
    Go,
    /// Waiting for a permit.
    Queued,
    /// Refused with this status at this time.
    Refused(u16, f64),
}

impl Limiter {
    pub fn of(knobs: &SmgKnobs) -> Option<Limiter> {
        Some(Limiter {
            max: knobs.max_concurrent?,
            queue_size: knobs.queue_size,
            timeout_s: knobs.queue_timeout_s,
            in_flight: 0,
            queue: VecDeque::new(),
        })
    }

    /// A request arrives at `t_s`.
    pub fn arrive(&mut self, id: u64, t_s: f64, body: &[u8]) -> Permit {
        if self.in_flight < self.max {
            self.in_flight += 1;
            Permit::Go
        } else if self.queue.len() < self.queue_size {
            self.queue.push_back(Queued {
                id,
                at_s: t_s,
                body: body.to_vec(),
            });
            Permit::Queued
        } else {
            Permit::Refused(429, t_s)
        }
    }

    /// A request in flight ended: its permit is free.
    pub fn done(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// At `t_s`: requests whose wait ran out (408 at their deadline), and
    /// those that get a permit now, with their bodies.
    pub fn settle(&mut self, t_s: f64) -> Vec<(u64, Settled)> {
        let mut out = Vec::new();
        let timeout = self.timeout_s;
        self.queue.retain(|q| {
            let expired = q.at_s + timeout <= t_s;
            if expired {
                out.push((q.id, Err((408, q.at_s + timeout))));
            }
            !expired
        });
        while self.in_flight < self.max {
            let Some(q) = self.queue.pop_front() else {
                break;
            };
            self.in_flight += 1;
            out.push((q.id, Ok(q.body)));
        }
        out
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

#[cfg(test)]
mod tests {
    use super::*;

    fn body(text: &str) -> Vec<u8> {
        serde_json::json!({"text": text, "sampling_params": {"max_new_tokens": 8}})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn knobs_come_from_smg_flags_and_unknown_flags_are_refused() {
        let args: Vec<String> = ["--cache-threshold", "0.6", "--balance-abs-threshold", "4"]
            .map(str::to_string)
            .to_vec();
        let knobs = SmgKnobs::from_args(&args).unwrap();
        assert_eq!(
            (knobs.cache_threshold, knobs.balance_abs, knobs.balance_rel),
            (0.6, 4.0, 1.5)
        );
        assert!(SmgKnobs::from_args(&["--policy".to_string(), "x".to_string()]).is_err());
        let limited = SmgKnobs::from_args(
            &[
                "--max-concurrent-requests",
                "2",
                "--queue-size",
                "1",
                "--queue-timeout-secs",
                "1",
            ]
            .map(str::to_string),
        )
        .unwrap();
        assert_eq!(
            (
                limited.max_concurrent,
                limited.queue_size,
                limited.queue_timeout_s
            ),
            (Some(2), 1, 1.0)
        );
        assert!(SmgKnobs::from_args(&["--cache-threshold".to_string()]).is_err());
    }

    #[test]
    fn the_limiter_queues_beyond_its_permits_and_times_out_or_refuses() {
        let knobs = SmgKnobs {
            max_concurrent: Some(1),
            queue_size: 1,
            queue_timeout_s: 1.0,
            ..SmgKnobs::default()
        };
        let mut l = Limiter::of(&knobs).unwrap();
        assert_eq!(l.arrive(1, 0.0, b"a"), Permit::Go);
        assert_eq!(l.arrive(2, 0.1, b"b"), Permit::Queued);
        assert_eq!(l.arrive(3, 0.2, b"c"), Permit::Refused(429, 0.2), "queue full");
        assert!(l.settle(0.5).is_empty(), "no permit free yet");
        l.done();
        assert_eq!(l.settle(0.6), vec![(2, Ok(b"b".to_vec()))]);
        assert_eq!(l.arrive(4, 0.7, b"d"), Permit::Queued);
        assert_eq!(l.settle(1.8), vec![(4, Err((408, 1.7)))], "at its deadline");
        assert!(Limiter::of(&SmgKnobs::default()).is_none());
    }

    #[test]
    fn a_shared_prefix_sticks_until_the_spill_gate_opens() {
        let shared = "a long system prompt that many requests share ".repeat(20);
        let text = |i: usize| format!("{shared} question {i}");
        // Default knobs: with 8 ranks the gate needs 4 more in flight than
        // the mean; nothing finishes, so the hot rank takes requests until then.
        let mut smg = CacheAware::new(2, 4, true, &SmgKnobs::default());
        let first = smg.route(&body(&text(0)));
        let same = (1..4).filter(|i| smg.route(&body(&text(*i))) == first).count();
        assert_eq!(same, 3);
        // A spill threshold of 1 sends the second one elsewhere at once.
        let eager = SmgKnobs {
            balance_abs: 1.0,
            balance_rel: 1.0,
            ..SmgKnobs::default()
        };
        let mut smg = CacheAware::new(2, 4, true, &eager);
        let first = smg.route(&body(&text(0)));
        let _ = smg.route(&body(&text(1)));
        assert_ne!(smg.route(&body(&text(2))), first);
        // Without --dp-aware the targets are workers and the rank is theirs to pick.
        let mut workers = CacheAware::new(2, 4, false, &SmgKnobs::default());
        let p = workers.route(&body(&text(0)));
        assert!(p.worker < 2 && p.rank.is_none());
        workers.done(p);
        assert_eq!(workers.in_flight, vec![0, 0]);
    }
}
