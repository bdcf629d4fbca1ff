//! What overload protection keeps per rank beside the queued prefill
//! (docs/overload.md): how fast the rank's waiting prompt tokens have
//! drained lately, learned from consecutive polls; its KV use; whether its
//! reports count waiting tokens at all; and the mean prompt of the requests
//! this gateway charged to it. Kept only while admission is on (the poller
//! starts it).

use super::UNKNOWN;
use crate::load::RankLoad;
use serde::{Deserialize, Serialize};

/// Horizon of the learned drain rate: observations fade with this time
/// constant (ms), so the rate follows a change of regime within a few
/// tens of seconds and one odd interval moves it little.
pub const DRAIN_WINDOW_MS: f64 = 20_000.0;
/// Weight of the configured rate, as if observed over this long (ms),
/// fading as the rank is seen busy: gone once it was busy for
/// [`LEARNED_AFTER_MS`] (decayed), so a rate far below the configured
/// one is learned in full.
pub const PRIOR_MS: f64 = 2_000.0;
pub const LEARNED_AFTER_MS: f64 = 5_000.0;
/// An interval longer than this between two snapshots teaches nothing (ms).
pub const MAX_LEARNING_INTERVAL_MS: u64 = 60_000;
/// Mean prompt assumed before any request was charged (tokens).
pub const DEFAULT_MEAN_PROMPT_TOKENS: f64 = 1024.0;

/// One rank's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct RankDrain {
    /// Prompt tokens drained while the queue stayed busy, decayed.
    drained: u64,
    /// Over how many ms, decayed alike.
    busy_ms: u64,
    /// Uncached prompt tokens charged since the last snapshot.
    arrived: u64,
    /// Reported KV use in 1/10000 (UNKNOWN: not reported).
    kv: u64,
    /// The last report counted the waiting prompt tokens.
    tokens_reported: bool,
    /// Uncached tokens and requests (in thousandths) charged, decayed:
    /// their mean prompt.
    charged_tokens: u64,
    charged_milli: u64,
}

/// Per rank, as the poller last applied it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainState {
    /// Empty until admission's first snapshot.
    ranks: Vec<RankDrain>,
}

/// What overload protection sees of one rank's queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankQueue {
    /// Uncached prompt tokens waiting (polled and routed since), if the
    /// rank's reports count them.
    pub tokens: Option<u64>,
    /// Requests waiting (polled and routed since).
    pub requests: u64,
    /// Mean uncached prompt of the requests charged to it lately.
    pub mean_request_tokens: f64,
    /// KV in use, 0..=1, if reported.
    pub kv_usage: Option<f64>,
    /// Requests on the rank: running as last reported, plus `requests`;
    /// None if its reports do not count running requests.
    pub in_flight: Option<u64>,
    /// Tokens per second its queue drains at (learned, or the prior).
    pub drain_tokens_per_s: f64,
    /// What SLO admission learned of it (nothing without).
    pub learned: super::slo::Learned,
}

fn decayed(v: u64, keep: f64) -> u64 {
    (v as f64 * keep).round() as u64
}

impl DrainState {
    pub fn within_limits(&self, max: usize) -> bool {
        self.ranks.len() <= max
    }

    /// Whether admission's snapshots have started it.
    pub fn is_tracking(&self) -> bool {
        !self.ranks.is_empty()
    }

    /// A request's uncached prompt was charged to `rank`.
    pub fn charged(&mut self, rank: usize, tokens: u64) {
        if let Some(d) = self.ranks.get_mut(rank) {
            d.arrived = d.arrived.saturating_add(tokens);
            d.charged_tokens = d.charged_tokens.saturating_add(tokens);
            d.charged_milli = d.charged_milli.saturating_add(1000);
        }
    }

    /// A snapshot `elapsed_ms` after the previous one (0: none before):
    /// `before` is each rank's waiting prompt tokens as the previous one
    /// reported them, `ranks` the new report. The gateway charged
    /// `arrived` tokens in between; other gateways about `gateways - 1`
    /// times as many. While the queue was not empty at either end, it
    /// drained `before + arrivals - now`.
    pub fn on_snapshot(&mut self, elapsed_ms: u64, before: &[u64], ranks: &[RankLoad], gateways: u32) {
        self.ranks.resize(ranks.len().max(1), RankDrain::default());
        let keep = (-(elapsed_ms as f64) / DRAIN_WINDOW_MS).exp();
        for (r, d) in self.ranks.iter_mut().enumerate() {
            let load = ranks.get(r);
            let now = load.and_then(|l| l.waiting_uncached_tokens);
            let was = before.get(r).copied().unwrap_or(0);
            let learns = (1..=MAX_LEARNING_INTERVAL_MS).contains(&elapsed_ms);
            if let (true, Some(now)) = (learns, now) {
                (d.drained, d.busy_ms) = (decayed(d.drained, keep), decayed(d.busy_ms, keep));
                if was > 0 && now > 0 {
                    let arrivals = d.arrived.saturating_mul(u64::from(gateways.max(1)));
                    d.drained = d
                        .drained
                        .saturating_add(was.saturating_add(arrivals).saturating_sub(now));
                    d.busy_ms = d.busy_ms.saturating_add(elapsed_ms);
                }
            }
            if learns {
                d.charged_tokens = decayed(d.charged_tokens, keep);
                d.charged_milli = decayed(d.charged_milli, keep);
            }
            d.arrived = 0;
            d.tokens_reported = now.is_some();
            d.kv = load
                .and_then(kv_usage)
                .map_or(UNKNOWN, |k| (k.clamp(0.0, 1.0) * 10_000.0).round() as u64);
        }
    }

    /// `rank`'s drain rate in tokens per second: what was learned (unless
    /// `learn` is off), with the configured `prior` weighed as up to
    /// [`PRIOR_MS`] of observation. Never below 1.
    pub fn rate(&self, rank: usize, prior: f64, learn: bool) -> f64 {
        let d = self.ranks.get(rank).filter(|_| learn);
        let (drained, busy) = d.map_or((0.0, 0.0), |d| (d.drained as f64, d.busy_ms as f64));
        let weight = PRIOR_MS * (1.0 - busy / LEARNED_AFTER_MS).max(0.0);
        if busy + weight <= 0.0 {
            return 1.0;
        }
        ((drained + prior * weight / 1000.0) / (busy + weight) * 1000.0).max(1.0)
    }

    /// Whether the rank's last report counted waiting tokens (true before
    /// any report: the queue is then the gateway's own, in tokens).
    pub fn tokens_reported(&self, rank: usize) -> bool {
        self.ranks.get(rank).is_none_or(|d| d.tokens_reported)
    }

    pub fn kv_usage(&self, rank: usize) -> Option<f64> {
        self.ranks
            .get(rank)
            .filter(|d| d.kv != UNKNOWN)
            .map(|d| d.kv as f64 / 10_000.0)
    }

    /// Mean uncached prompt of the requests charged to `rank` lately.
    pub fn mean_request_tokens(&self, rank: usize) -> f64 {
        match self.ranks.get(rank) {
            Some(d) if d.charged_milli > 0 => d.charged_tokens as f64 * 1000.0 / d.charged_milli as f64,
            _ => DEFAULT_MEAN_PROMPT_TOKENS,
        }
    }
}

/// A rank's KV use: as reported, else used / capacity.
fn kv_usage(load: &RankLoad) -> Option<f64> {
    load.kv_usage
        .or_else(|| match (load.used_tokens, load.capacity_tokens) {
            (Some(used), Some(cap)) if cap > 0 => Some(used as f64 / cap as f64),
            _ => None,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(tokens: &[Option<u64>]) -> Vec<RankLoad> {
        tokens
            .iter()
            .map(|t| RankLoad {
                waiting_uncached_tokens: *t,
                used_tokens: Some(500),
                capacity_tokens: Some(1000),
                ..RankLoad::default()
            })
            .collect()
    }

    #[test]
    fn without_observations_the_rate_is_the_prior() {
        let d = DrainState::default();
        assert!(!d.is_tracking());
        assert_eq!(d.rate(0, 10_000.0, true), 10_000.0);
        assert!(d.tokens_reported(3));
        assert_eq!(d.mean_request_tokens(0), DEFAULT_MEAN_PROMPT_TOKENS);
    }

    #[test]
    fn a_busy_queue_teaches_how_fast_it_drains() {
        let mut d = DrainState::default();
        d.on_snapshot(0, &[], &waiting(&[Some(4000), Some(0)]), 1);
        assert!(d.is_tracking());
        assert_eq!(d.kv_usage(0), Some(0.5), "used / capacity");
        // Every second: 4000 waiting, 1000 more charged, 4000 waiting again:
        // 1000 tokens a second drained.
        for _ in 0..40 {
            d.charged(0, 1000);
            d.on_snapshot(1000, &[4000, 0], &waiting(&[Some(4000), Some(0)]), 1);
        }
        let learned = d.rate(0, 10_000.0, true);
        assert!((1000.0..1500.0).contains(&learned), "{learned}");
        assert_eq!(d.rate(0, 10_000.0, false), 10_000.0, "learning off");
        assert_eq!(
            d.rate(1, 10_000.0, true),
            10_000.0,
            "an idle rank teaches nothing"
        );
        assert!((d.mean_request_tokens(0) - 1000.0).abs() < 1.0);
    }

    #[test]
    fn other_gateways_arrivals_are_counted_and_a_stuck_queue_drains_at_almost_nothing() {
        let mut two = DrainState::default();
        two.on_snapshot(0, &[], &waiting(&[Some(100)]), 2);
        for _ in 0..40 {
            two.charged(0, 500);
            two.on_snapshot(1000, &[100], &waiting(&[Some(100)]), 2);
        }
        let rate = two.rate(0, 10_000.0, true);
        assert!((1000.0..1400.0).contains(&rate), "our 500 and theirs: {rate}");
        let mut stuck = DrainState::default();
        stuck.on_snapshot(0, &[], &waiting(&[Some(100)]), 1);
        for _ in 0..200 {
            stuck.on_snapshot(1000, &[100], &waiting(&[Some(100)]), 1);
        }
        assert!(stuck.rate(0, 10_000.0, true) < 200.0);
    }

    #[test]
    fn reports_without_token_counts_and_kv_as_reported() {
        let mut d = DrainState::default();
        let vllm = vec![RankLoad {
            waiting_requests: Some(3),
            running_requests: Some(40),
            kv_usage: Some(0.9),
            ..RankLoad::default()
        }];
        d.on_snapshot(0, &[], &vllm, 1);
        assert!(!d.tokens_reported(0));
        assert_eq!(d.kv_usage(0), Some(0.9));
        d.on_snapshot(1000, &[0], &vllm, 1);
        assert_eq!(d.rate(0, 5000.0, true), 5000.0, "nothing learned without tokens");
    }
}
