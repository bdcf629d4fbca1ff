//! Stage `refresh`, and stage `pool`: the fleet as one request sees it.
//! Refreshing reads the workers' states and the health record into the VM's
//! cache, the clock once, and decides whether this request may probe a
//! worker or rank past its cooldown; every later stage reads the snapshot,
//! admission the queues of the ranks the request could be sent to.

use crate::config::Config;
use crate::health::{self, Health};
use crate::host::Host;
use crate::scheduler::{Constraint, Context, Pool};
use crate::shared_data::cache::StateCache;
use crate::worker_state::saturation::Rule;
use crate::worker_state::RankQueue;
use std::rc::Rc;

/// Which pool a leg of a request chooses from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// Where requests are forwarded: the workers, or PD's decode pool.
    Forward,
    /// PD's prefill pool.
    Prefill,
}

/// The states, loads and health record as refreshed for one request, the
/// clock it read, and what it may do with them.
pub(crate) struct Snapshot<'a> {
    pub config: &'a Config,
    cache: &'a StateCache,
    pub now_ms: u64,
    /// This request may go to a worker or rank past its cooldown (a probe).
    pub admit_probing: bool,
    /// Varies per request so that equal costs spread.
    pub tie_breaker: u64,
    /// Admission let the request in by this rule: the judged side chooses
    /// among ranks with room by it (None: no admission, or no data to judge).
    pub rule: Option<(Side, Rule)>,
}

/// When a request was routed and whether the health record listed nothing
/// then (its success then needs no write), kept past the snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Moment {
    pub routed_at_ms: u64,
    pub health_was_clean: bool,
}

/// Stage `refresh`: reads the shared states and health record into
/// `cache` (those that changed), and the clock.
pub(crate) fn refresh<'a>(
    config: &'a Rc<Config>,
    host: &dyn Host,
    cache: &'a mut StateCache,
    tie_breaker: u64,
) -> Snapshot<'a> {
    cache.refresh(config, host);
    let now_ms = host.now_ms();
    let health = cache.health();
    let admit_probing = config
        .passive_health
        .as_ref()
        .is_some_and(|p| health.any_probing(now_ms) && health::is_probe(p.probe_share, tie_breaker));
    Snapshot {
        config,
        cache,
        now_ms,
        admit_probing,
        tie_breaker,
        rule: None,
    }
}

impl<'a> Snapshot<'a> {
    /// The health record as read (empty when the configuration reads none).
    pub fn health(&self) -> &'a Health {
        self.cache.health()
    }

    pub fn moment(&self) -> Moment {
        Moment {
            routed_at_ms: self.now_ms,
            health_was_clean: self.health().entries.is_empty(),
        }
    }

    /// Stage `pool`: the workers `side` chooses among, with their states
    /// and loads as refreshed.
    pub fn pool(&self, side: Side) -> Pool<'a> {
        let config = self.config;
        let (workers, offset) = match (side, config.pd()) {
            (Side::Prefill, Some(pd)) => (pd.prefill.as_slice(), config.prefill_offset()),
            _ => (config.routed(), 0),
        };
        Pool {
            workers,
            states: self
                .cache
                .states()
                .get(offset..offset + workers.len())
                .unwrap_or_default(),
            loads: self.cache.loads(),
            offset,
        }
    }

    /// The scheduler's context for `constraint` (load only: the choose
    /// stage adds prefix affinity).
    pub fn context<'c>(&self, constraint: Constraint<'c>) -> Context<'c>
    where
        'a: 'c,
    {
        Context {
            now_ms: self.now_ms,
            stale_after_ms: self.config.stale_after_ms,
            constraint,
            tie_breaker: self.tie_breaker,
            health: self.health(),
            admit_probing: self.admit_probing,
            prefix: None,
            pick: self.config.pick,
            gateways: self.config.gateways,
            room: None,
        }
    }

    /// Admission's rule for a leg on `side`, if it let the request in.
    pub fn rule_for(&self, side: Side) -> Option<Rule> {
        self.rule.filter(|(s, _)| *s == side).map(|(_, rule)| rule)
    }

    /// The pool admission judges: PD's prefill pool (where requests queue
    /// before their first token), else the forwarded one.
    pub fn judged_side(&self) -> Side {
        match self.config.pd() {
            Some(_) => Side::Prefill,
            None => Side::Forward,
        }
    }

    /// The queues, as `rule` reads them (None: none), of the ranks a request
    /// could be sent to on `side`: fresh workers in rotation (no probes),
    /// ranks with a known load and not ejected.
    pub fn candidate_queues(&self, side: Side, rule: Option<Rule>) -> impl Iterator<Item = RankQueue> + 'a {
        let pool = self.pool(side);
        let (now, stale) = (self.now_ms, self.config.stale_after_ms);
        let health = self.health();
        pool.workers
            .iter()
            .zip(pool.states.iter())
            .filter_map(move |(worker, state)| {
                let rule = rule?;
                let state = state.as_ref().filter(|s| s.is_fresh(now, stale))?;
                let out: Vec<u32> = health.admitted(worker.address, now, false)?.collect();
                Some((rule, state, out))
            })
            .flat_map(move |(rule, state, out)| {
                (0..state.ranks())
                    .filter(move |r| state.effective_tokens(*r).is_some() && !out.contains(&(*r as u32)))
                    .map(move |r| rule.queue(state, r))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::{Outcome, Target};
    use crate::shared_data::testing::{fleet, pd_fleet};

    #[test]
    fn refresh_reads_the_fleet_and_the_clock_once() {
        let (c, h) = fleet("");
        let mut cache = StateCache::default();
        let (reads, clocks) = (h.host_calls("shared_get"), h.host_calls("now_ms"));
        let snap = refresh(&c, &h, &mut cache, 1);
        assert_eq!(
            h.host_calls("shared_get") - reads,
            2 + 1,
            "two states, the health record"
        );
        assert_eq!(h.host_calls("now_ms") - clocks, 1);
        assert_eq!(snap.now_ms, 10_000);
        assert!(!snap.admit_probing && snap.moment().health_was_clean);
        let pool = snap.pool(Side::Forward);
        assert_eq!((pool.workers.len(), pool.offset), (2, 0));
        assert!(pool.states.iter().all(Option::is_some));
    }

    #[test]
    fn a_request_may_probe_only_while_something_is_probing() {
        let (c, h) =
            fleet(r#","passive_health":{"consecutive_failures":1,"cooldown_ms":100,"probe_share":1}"#);
        let a = Target {
            worker: c.routed()[0].address,
            rank: None,
        };
        crate::health_updates::record(&c, &h, &[(a, Outcome::Failure)], 10_000, false);
        let mut cache = StateCache::default();
        let snap = refresh(&c, &h, &mut cache, 1);
        assert!(!snap.admit_probing, "ejected, not probing yet");
        assert!(!snap.moment().health_was_clean);
        h.now.set(10_200);
        assert!(
            refresh(&c, &h, &mut cache, 1).admit_probing,
            "past its cooldown, every request probes"
        );
    }

    #[test]
    fn the_prefill_pool_follows_the_routed_one() {
        let (c, h) = pd_fleet("");
        let mut cache = StateCache::default();
        let snap = refresh(&c, &h, &mut cache, 0);
        let (decode, prefill) = (snap.pool(Side::Forward), snap.pool(Side::Prefill));
        assert_eq!((decode.offset, decode.workers[0].name.as_str()), (0, "d0"));
        assert_eq!((prefill.offset, prefill.workers[0].name.as_str()), (2, "p0"));
        assert_eq!(prefill.states.len(), 2);
    }
}
