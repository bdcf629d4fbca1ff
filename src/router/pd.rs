//! PD mode (prefill/decode disaggregation): a prefill and a decode (worker,
//! rank), each a leg of the routing pipeline (`pipeline.rs`), the bootstrap
//! fields that make the two legs meet, and what the prefill leg's outcome
//! means for the client. What differs from body mode: two legs (the prefill
//! one with prefix affinity and no alternates, the decode one by load with
//! them), a body that is not a JSON object is refused in every mode, and a
//! leg without fresh data still goes (prefill workers take turns, the
//! decode worker is the cluster's pick).

use super::body_fields::{estimated_tokens, prefix_request, queue_charge, server_priority, with_priority};
use super::outcome::{reject, PassReason, RejectReason};
use super::pipeline::{self, Choice, Committed, Leg, RouteArgs};
use super::snapshot::{Moment, Side, Snapshot};
use super::{Chosen, Decision, Reply};
use crate::body::{bootstrap_fields, JsonObject};
use crate::config::{Config, Pd, RankOf, Worker};
use crate::health::{classify, targets, Outcome};
use crate::health_updates;
use crate::host::Host;
use crate::metrics::{self, PerWorker};
use crate::prefix::RequestPrefix;
use crate::scheduler::Constraint;
use crate::shared_data::cache::StateCache;
use crate::shared_data::{self, IfMissing};
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
    pub prefill_ticket: Option<Ticket>,
    pub decode_ticket: Option<Ticket>,
    /// Prefix affinity: the prefill charged to the prefill rank (over when
    /// the prefill leg answers).
    pub prefill_charge: Option<PrefillTicket>,
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
) -> Decision {
    let (pin, tie_breaker) = (args.pin, args.tie_breaker);
    let object = match JsonObject::parse(body) {
        // Without the bootstrap fields neither side could serve it.
        Err(e) => {
            let refusal = RejectReason::from(e);
            return reject(host, refusal, refusal.reply());
        }
        Ok(o) => o,
    };
    let snapshot = match pipeline::start(config, host, cache, args) {
        Ok(snapshot) => snapshot,
        Err(refused) => return refused.into(),
    };
    let mut prefix = prefix_request(config, &object, snapshot.now_ms);
    let (prefill, decode) = choose_legs(host, &snapshot, pin, prefix.as_mut());
    let moment = snapshot.moment();
    // Without prefill data the prefill workers take turns and pick their own rank.
    let turn = (tie_breaker % pd.prefill.len().max(1) as u64) as usize;
    let prefill_index = prefill
        .as_ref()
        .map_or(config.prefill_offset() + turn, |c| c.chosen.worker);
    let Some(prefill_worker) = config.worker(prefill_index) else {
        // Only an empty prefill pool, which validation refuses, names no worker.
        let refusal = RejectReason::NoFreshData;
        return reject(host, refusal, refusal.reply());
    };
    let cost = estimated_tokens(config, &object, prefix.as_ref());
    // Admission judges the prefill pool: its queue is the prefill leg's.
    let queued = queue_charge(config, &object, prefix.as_ref());
    let prefill = prefill.map(|c| pipeline::commit(config, host, cache, &c, cost, prefix.as_mut(), queued));
    let decode = decode.map(|c| pipeline::commit(config, host, cache, &c, cost, None, None));
    let prefill_to = prefill
        .as_ref()
        .map_or_else(|| Chosen::new(cache, prefill_index, None), |p| p.to.clone());
    let legs = Legs {
        prefill_to,
        prefill,
        decode,
        moment,
        priority: server_priority(config, args.class),
    };
    reply(pd, host, &object, prefill_worker, legs)
}

/// Stage `choose` of both legs: the prefill rank by prefix and load
/// (`pin`'s first half), the decode rank by load with its retry
/// alternates (its second half); a leg without fresh data is counted.
fn choose_legs(
    host: &dyn Host,
    snapshot: &Snapshot,
    pin: Option<&str>,
    prefix: Option<&mut RequestPrefix>,
) -> (Option<Choice>, Option<Choice>) {
    let (prefill_pin, decode_pin) = split_pin(pin);
    let leg = |side, pin, alternates| Leg {
        side,
        constraint: Constraint { only_rank: None, pin },
        alternates,
    };
    let prefill = pipeline::choose(host, snapshot, &leg(Side::Prefill, prefill_pin, 0), prefix);
    let alternates = snapshot.config.retry_alternates as usize;
    let decode = pipeline::choose(host, snapshot, &leg(Side::Routed, decode_pin, alternates), None);
    if prefill.is_none() {
        host.count(metrics::NO_FRESH_PREFILL_DATA, 1);
    }
    if decode.is_none() {
        host.count(&metrics::passthrough(PassReason::NoFreshData.as_str()), 1);
    }
    (prefill, decode)
}

/// Both legs as committed (a leg without fresh data is not).
struct Legs {
    prefill_to: Chosen,
    prefill: Option<Committed>,
    decode: Option<Committed>,
    moment: Moment,
    /// Server priority, written into both legs (`body_fields::server_priority`).
    priority: Option<Option<i64>>,
}

/// Stage `reply` of PD mode: each leg's body, with the bootstrap fields
/// (drawn here) and the rank fields whose rank is known.
fn reply(pd: &Pd, host: &dyn Host, object: &JsonObject, prefill_worker: &Worker, legs: Legs) -> Decision {
    let bootstrap = bootstrap_fields(
        object,
        prefill_worker.address.ip(),
        prefill_worker.bootstrap_port,
        || host.random_u64(),
    );
    let decode_rank = legs.decode.as_ref().and_then(|d| d.to.rank);
    let ranks = (legs.prefill_to.rank, decode_rank);
    let mut neutralise = pd.field_names();
    let mut priority = Vec::new();
    with_priority(legs.priority, &mut priority, &mut neutralise);
    let body_for = |fields| {
        let mut set = pd_body_fields(&bootstrap, fields, ranks);
        set.extend(priority.iter().cloned());
        object.rewritten(&set, &neutralise)
    };
    let (prefill_ticket, prefill_charge) = legs.prefill.map_or((None, None), |p| (p.ticket, p.prefill));
    let (decode, decode_alternates, decode_ticket) = match legs.decode {
        Some(d) => (Some(d.to), d.alternates, d.ticket),
        None => (None, Vec::new(), None),
    };
    Decision::Pd(PdRouted {
        prefill: legs.prefill_to,
        decode,
        decode_alternates,
        health_was_clean: legs.moment.health_was_clean,
        routed_at_ms: legs.moment.routed_at_ms,
        prefill_body: body_for(&pd.prefill_body_fields),
        decode_body: body_for(&pd.decode_body_fields),
        prefill_ticket,
        decode_ticket,
        prefill_charge,
    })
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

/// What the client gets when the prefill leg ended: None if it succeeded,
/// else the error reply. A prefill that did not answer at all also takes its
/// worker out of rotation until its next good poll.
pub fn prefill_outcome(
    config: &Config,
    host: &dyn Host,
    worker: usize,
    status: Option<u32>,
    body: &[u8],
) -> Option<Reply> {
    let (endpoint, name) = config
        .worker(worker)
        .map(|w| (w.endpoint(), w.name.clone()))
        .unwrap_or_default();
    if let Some(200..=299) = status {
        host.count(&PerWorker::PrefillOk.of(&name), 1);
        return None;
    }
    host.count(&PerWorker::PrefillFailed.of(&name), 1);
    // Envoy answers 503 itself when it cannot connect; 502/504 mean the same
    // from a proxy in between. Either way, stop sending there until a poll succeeds.
    if matches!(status, None | Some(502..=504)) {
        mark_unreachable(config, host, worker);
    }
    Some(Reply::prefill_failed(&endpoint, status, body))
}

/// What the prefill leg's answer tells passive health about its worker and
/// rank: an answer other than 5xx (and 429) is a success, a 5xx a failure of
/// the rank, no answer at all (refused, reset, timeout) the worker's
/// (unreachable).
pub fn prefill_health(
    config: &Config,
    host: &dyn Host,
    worker: usize,
    rank: Option<u32>,
    status: Option<u32>,
    routed_at_ms: u64,
) {
    let Some(w) = config.worker(worker) else {
        return;
    };
    let outcome = match status {
        None => Outcome::Unreachable,
        Some(code) => classify(Some(u64::from(code)), Some("via_upstream")),
    };
    if outcome == Outcome::Neutral {
        return;
    }
    let observed = targets(w.address, rank, outcome);
    health_updates::record(config, host, &observed, routed_at_ms, false);
}

/// The prefill leg could not even be dispatched (Envoy refused the call).
pub fn prefill_not_sent(config: &Config, host: &dyn Host, worker: usize) -> Reply {
    let name = config.worker(worker).map(|w| w.name.clone()).unwrap_or_default();
    host.count(&PerWorker::PrefillFailed.of(&name), 1);
    Reply::prefill_not_sent()
}

/// A prefill worker that could not be reached gets no more requests until a
/// poll succeeds again.
pub fn mark_unreachable(config: &Config, host: &dyn Host, worker: usize) {
    shared_data::update_worker(config, host, worker, IfMissing::Skip, |state| {
        state.mark_unreachable();
        Some(())
    });
}

#[cfg(test)]
mod tests;
