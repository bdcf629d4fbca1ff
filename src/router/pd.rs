//! PD mode (prefill/decode disaggregation): a prefill and a decode (worker,
//! rank), the two legs of one run of the routing pipeline (`pipeline.rs`),
//! and the bootstrap fields that make the two legs meet. What differs from
//! body mode: two legs (the prefill one with prefix affinity and no
//! alternates, the decode one by load with them), a body that is not a JSON
//! object is refused in every mode, and a leg without fresh data still goes
//! (prefill workers take turns, the decode worker is the cluster's pick).
//! The request lifecycle sends the prefill leg (`request/prefill.rs`).

use super::body_fields::{estimated_tokens, prefill_charge, prefix_request, server_priority, with_priority};
use super::outcome::{reject, PassReason, RejectReason};
use super::pipeline::{self, Choice, Committed, Leg, Legs, Path, PrefillCharge, RouteArgs, Unchosen};
use super::snapshot::{Moment, Side, Snapshot};
use super::{Chosen, Decision};
use crate::admission::Overloaded;
use crate::body::{bootstrap_fields, JsonObject};
use crate::config::{Config, Pd, RankOf};
use crate::host::Host;
use crate::metrics;
use crate::prefix::RequestPrefix;
use crate::scheduler::Constraint;
use crate::shared_data::cache::StateCache;
use crate::worker_state::{PrefillTicket, Ticket};
use std::rc::Rc;

#[derive(Debug, PartialEq, Eq)]
pub struct PdRouted {
    pub prefill: Chosen,
    /// None when no decode worker has fresh data: the cluster's fallback picks.
    pub decode: Option<Chosen>,
    /// Other decode workers with the decode rank, for Envoy's retries.
    pub decode_alternates: Vec<Chosen>,
    /// The health record listed nothing when the request was routed.
    pub health_was_clean: bool,
    /// When it was routed (the clock the choice read).
    pub routed_at_ms: u64,
    pub prefill_body: Vec<u8>,
    pub decode_body: Vec<u8>,
    /// The estimate added to the prefill rank (given back when the prefill
    /// leg answers).
    pub prefill_estimate: Option<Ticket>,
    /// The estimate added to the decode rank (given back at the end).
    pub decode_estimate: Option<Ticket>,
    /// The prompt queued on the prefill rank (taken back when the prefill
    /// leg answers).
    pub queued_prefill: Option<PrefillTicket>,
}

/// The test pin `prefill_worker/rank,decode_worker/rank`: either side may be empty.
fn split_pin(pin: Option<&str>) -> (Option<&str>, Option<&str>) {
    fn side(s: &str) -> Option<&str> {
        Some(s.trim()).filter(|s| !s.is_empty())
    }
    match pin.map(|p| p.split_once(',').unwrap_or((p, ""))) {
        Some((p, d)) => (side(p), side(d)),
        None => (None, None),
    }
}

/// Picks a prefill and a decode (worker, rank) and writes the bootstrap
/// fields both sides need to meet.
pub(super) fn route_pd(
    config: &Rc<Config>,
    pd: &Pd,
    host: &dyn Host,
    cache: &mut StateCache,
    body: &[u8],
    args: &RouteArgs,
) -> Result<Decision, Overloaded> {
    let object = match JsonObject::parse(body) {
        // Without the bootstrap fields neither side could serve it.
        Err(e) => {
            let refusal = RejectReason::from(e);
            return Ok(reject(host, refusal, refusal.reply()));
        }
        Ok(o) => o,
    };
    let path = PdPath {
        config,
        pd,
        object,
        tie_breaker: args.tie_breaker,
        class: args.class,
    };
    pipeline::run(config, host, cache, args, path)
}

/// PD mode's path through the pipeline.
struct PdPath<'c, 'b> {
    config: &'c Config,
    pd: &'c Pd,
    object: JsonObject<'b>,
    /// Without prefill data the prefill workers take turns by it.
    tie_breaker: u64,
    /// Admission's class, for the server priority written into both legs.
    class: Option<usize>,
}

impl<'c> Path<'c> for PdPath<'c, '_> {
    /// The prefill leg by prefix and load with no alternates (`pin`'s
    /// first half), then the decode leg by load with its retry alternates
    /// (its second half).
    fn legs<'p>(&self, config: &Config, pin: Option<&'p str>) -> Legs<'p> {
        let (prefill_pin, decode_pin) = split_pin(pin);
        let leg = |side, pin, alternates| Leg {
            side,
            constraint: Constraint { only_rank: None, pin },
            alternates,
        };
        Legs {
            first: leg(Side::Prefill, prefill_pin, 0),
            second: Some(leg(Side::Forward, decode_pin, config.retry_alternates as usize)),
        }
    }

    fn prefix(&self, config: &'c Config, now_ms: u64) -> Option<RequestPrefix<'c>> {
        prefix_request(config, &self.object, now_ms)
    }

    /// A leg without fresh data is counted, and still goes.
    fn found(&self, host: &dyn Host, prefill: Option<&Choice>, decode: Option<&Choice>) {
        if prefill.is_none() {
            host.count(metrics::NO_FRESH_PREFILL_DATA, 1);
        }
        if decode.is_none() {
            host.count(&metrics::passthrough(PassReason::NoFreshData.as_str()), 1);
        }
    }

    /// Without prefill data the prefill workers take turns and pick their
    /// own rank.
    fn unchosen(&self, host: &dyn Host, _snapshot: &Snapshot) -> Unchosen {
        let turn = (self.tie_breaker % self.pd.prefill.len().max(1) as u64) as usize;
        let worker = self.config.prefill_offset() + turn;
        match self.config.worker(worker) {
            Some(_) => Unchosen::GoesTo(worker),
            // Only an empty prefill pool, which validation refuses, names no worker.
            None => Unchosen::Decided(no_prefill_worker(host)),
        }
    }

    fn cost(&self, config: &Config, prefix: Option<&RequestPrefix>) -> u64 {
        estimated_tokens(config, &self.object, prefix)
    }

    /// Admission judges the prefill pool: its queue is the prefill leg's.
    fn prefill_charge(&self, config: &Config, prefix: Option<&RequestPrefix>) -> Option<PrefillCharge> {
        prefill_charge(config, &self.object, prefix)
    }

    /// Each leg's body, with the bootstrap fields (drawn here) and the rank
    /// fields whose rank is known.
    fn reply(
        self,
        host: &dyn Host,
        prefill: Committed,
        decode: Option<Committed>,
        moment: Moment,
    ) -> Decision {
        let (pd, object) = (self.pd, &self.object);
        let Some(prefill_worker) = self.config.worker(prefill.chosen.worker) else {
            return no_prefill_worker(host);
        };
        let bootstrap = bootstrap_fields(
            object,
            prefill_worker.address.ip(),
            prefill_worker.bootstrap_port,
            || host.random_u64(),
        );
        let decode_rank = decode.as_ref().and_then(|d| d.chosen.rank);
        let ranks = (prefill.chosen.rank, decode_rank);
        let mut neutralise = pd.field_names();
        let mut priority = Vec::new();
        with_priority(
            server_priority(self.config, self.class),
            &mut priority,
            &mut neutralise,
        );
        let body_for = |fields| {
            let mut set = pd_body_fields(&bootstrap, fields, ranks);
            set.extend(priority.iter().cloned());
            object.rewritten(&set, &neutralise)
        };
        let (decode, decode_alternates, decode_estimate) = match decode {
            Some(d) => (Some(d.chosen), d.alternates, d.estimate),
            None => (None, Vec::new(), None),
        };
        Decision::Pd(PdRouted {
            prefill: prefill.chosen,
            decode,
            decode_alternates,
            health_was_clean: moment.health_was_clean,
            routed_at_ms: moment.routed_at_ms,
            prefill_body: body_for(&pd.prefill_body_fields),
            decode_body: body_for(&pd.decode_body_fields),
            prefill_estimate: prefill.estimate,
            decode_estimate,
            queued_prefill: prefill.queued_prefill,
        })
    }
}

/// No prefill worker to send the request to.
fn no_prefill_worker(host: &dyn Host) -> Decision {
    let refusal = RejectReason::NoFreshData;
    reject(host, refusal, refusal.reply())
}

/// The bootstrap fields plus each rank field whose rank is known; `ranks` is
/// (prefill rank, decode rank).
fn pd_body_fields<'a>(
    bootstrap: &[(&'a str, String)],
    rank_fields: &'a [(String, RankOf)],
    ranks: (Option<u32>, Option<u32>),
) -> Vec<(&'a str, String)> {
    let mut set = bootstrap.to_vec();
    for (name, of) in rank_fields {
        let rank = match of {
            RankOf::Prefill => ranks.0,
            RankOf::Decode => ranks.1,
        };
        if let Some(rank) = rank {
            set.push((name.as_str(), rank.to_string()));
        }
    }
    set
}

#[cfg(test)]
mod tests;
