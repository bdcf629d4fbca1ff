//! PD mode (prefill/decode disaggregation): a prefill and a decode (worker,
//! rank) from their pools, the bootstrap fields that make the two legs meet,
//! and what the prefill leg's outcome means for the client.

use super::{
    account, choose, parse_body, pool, prefix_request, record, reject, retry_targets, Chosen, Decision,
    PassReason, Prefill, Reply, Sight,
};
use crate::body::bootstrap_fields;
use crate::config::{Config, Pd, RankOf};
use crate::health::{classify, targets, Outcome};
use crate::health_updates;
use crate::host::Host;
use crate::metrics::{self, PerWorker};
use crate::scheduler::Constraint;
use crate::state::{PrefillTicket, Ticket};
use crate::store::cache::StateCache;
use crate::store::{self, IfMissing};
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
    pin: Option<&str>,
    tie_breaker: u64,
) -> Decision {
    let object = match parse_body(body) {
        // Without the bootstrap fields neither side could serve it.
        Err(reason) => return reject(host, reason, Reply::not_an_object()),
        Ok(o) => o,
    };
    let (prefill_pin, decode_pin) = split_pin(pin);
    cache.refresh(config, host);
    let sight = Sight::new(config, host, cache.health(), tie_breaker);
    // The prefill rank is chosen by prefix and load, the decode rank by load.
    let prefill_offset = pool(config, cache, true).offset;
    let mut prefix = prefix_request(config, &object, sight.now_ms);
    let p = choose(
        config,
        host,
        &sight,
        &pool(config, cache, true),
        Constraint {
            only_rank: None,
            pin: prefill_pin,
        },
        tie_breaker,
        prefix.as_mut(),
        // Alternates are listed for the decode leg only.
        0,
    )
    .map(|(c, _)| c);
    let d = choose(
        config,
        host,
        &sight,
        &pool(config, cache, false),
        Constraint {
            only_rank: None,
            pin: decode_pin,
        },
        tie_breaker,
        None,
        config.retry_alternates as usize,
    );
    let decode_alternates = d
        .as_ref()
        .map(|(_, found)| retry_targets(config, host, cache, found))
        .unwrap_or_default();
    let d = d.map(|(c, _)| c);
    let (health_was_clean, routed_at_ms) = (sight.health.entries.is_empty(), sight.now_ms);
    if p.is_none() {
        host.count(metrics::NO_FRESH_PREFILL_DATA, 1);
    }
    if d.is_none() {
        host.count(&metrics::passthrough(PassReason::NoFreshData.as_str()), 1);
    }
    // Without prefill data the prefill workers take turns and pick their own rank.
    let turn = (tie_breaker % pd.prefill.len().max(1) as u64) as usize;
    let prefill_index = p.map_or(config.prefill_offset() + turn, |c| c.worker);
    let Some(prefill_worker) = config.worker(prefill_index) else {
        // Only an empty prefill pool, which validation refuses, names no worker.
        return reject(host, PassReason::NoFreshData, Reply::no_fresh_data());
    };

    let cost = super::estimated_tokens(config, &object, prefix.as_ref());
    let (prefill_ticket, prefill_charge) = match p {
        Some(c) => {
            let charge = Prefill::of(prefix.as_ref(), c.worker - prefill_offset, c.rank);
            let tickets = account(config, host, cache, c.worker, c.rank, cost, charge);
            record(
                config,
                host,
                prefix.as_mut(),
                cache,
                prefill_offset,
                c.worker,
                c.rank,
            );
            tickets
        }
        None => (None, None),
    };
    let decode_ticket = d.and_then(|c| account(config, host, cache, c.worker, c.rank, cost, None).0);

    let bootstrap = bootstrap_fields(
        &object,
        prefill_worker.address.ip(),
        prefill_worker.bootstrap_port,
        || host.random_u64(),
    );
    let ranks = (p.map(|c| c.rank), d.map(|c| c.rank));
    let neutralise = pd.field_names();
    let body_for = |fields| object.rewritten(&pd_body_fields(&bootstrap, fields, ranks), &neutralise);
    Decision::Pd(PdRouted {
        prefill: Chosen::new(cache, prefill_index, ranks.0),
        decode: d.map(|c| Chosen::new(cache, c.worker, Some(c.rank))),
        decode_alternates,
        health_was_clean,
        routed_at_ms,
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
    store::update_worker(config, host, worker, IfMissing::Skip, |state| {
        state.mark_unreachable();
        Some(())
    });
}

#[cfg(test)]
mod tests;
