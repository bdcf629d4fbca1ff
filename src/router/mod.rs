//! Per-request routing: a request in, a [`Decision`] out. Knows nothing of
//! proxy-wasm; `request.rs` applies the decision. Every path (body mode in
//! `by_body.rs`, header mode in `by_header.rs`, PD mode in `pd.rs`) runs
//! one pipeline (`pipeline.rs`): refresh, admission, pool, choose, retry
//! targets, account, record, reply. A request not routed is passed through
//! or refused (`outcome.rs`); every local answer is in `replies.rs`.

pub mod admission;
mod body_fields;
mod by_body;
mod by_header;
mod outcome;
mod pd;
mod pipeline;
mod rank_refusal;
mod replies;
mod snapshot;

pub use admission::{queue as admission_queue, Overload};
pub(crate) use body_fields::server_priority;
pub use body_fields::PRIORITY_FIELD;
pub use by_body::{route, route_with};
pub use by_header::{cost_from_length, route_by_headers, route_by_headers_with};
pub use outcome::{pass_early, pass_or_reject, PassReason, RejectReason};
pub use pd::{mark_unreachable, prefill_health, prefill_not_sent, prefill_outcome, PdRouted};
pub use pipeline::RouteArgs;
pub use rank_refusal::{rank_refused, Written, REFUSAL_BYTES};
pub use replies::Reply;

use crate::config::Config;
use crate::host::Host;
use crate::shared_data::cache::StateCache;
use crate::worker_state::{PrefillTicket, Ticket};
use pipeline::Committed;
use snapshot::Moment;
use std::borrow::Cow;
use std::rc::Rc;

/// A worker chosen for a request and, when load data allowed a choice, its rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    /// Index in `Config::all_workers`.
    pub worker: usize,
    /// The rank's index among the worker's ranks.
    pub rank: Option<u32>,
    /// The value written for it (body field or rank header), as the worker
    /// reads it (`worker_state::rank_value`); None: none is written.
    pub value: Option<u32>,
    /// Value for the route header (`ip:port`): the worker's, or its
    /// rank's own port (`rank_ports`).
    pub endpoint: Rc<str>,
}

impl Chosen {
    fn new(cache: &StateCache, worker: usize, rank: Option<u32>) -> Chosen {
        Chosen {
            worker,
            rank,
            value: rank.and_then(|r| cache.rank_value(worker, r)),
            endpoint: cache.rank_endpoint(worker, rank),
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub struct Routed {
    pub to: Chosen,
    /// Other workers with the same rank, cheapest first, for Envoy's retries.
    pub alternates: Vec<Chosen>,
    /// The rewritten body, or None to keep the client's (a trusted client rank).
    pub body: Option<Vec<u8>>,
    /// To release when the request ends; None if accounting could not be written.
    pub ticket: Option<Ticket>,
    /// The health record listed nothing when the request was routed: its
    /// success needs no write.
    pub health_was_clean: bool,
    /// When it was routed (the clock the choice read).
    pub routed_at_ms: u64,
    /// Prefix affinity: the prefill charged to the rank, to take back at
    /// the first response byte (or the end).
    pub prefill: Option<PrefillTicket>,
}

impl Routed {
    /// Stage `reply` of body and header mode: a committed leg, routed at
    /// `moment`, with the rewritten body if any.
    fn new(committed: Committed, moment: Moment, body: Option<Vec<u8>>) -> Routed {
        Routed {
            to: committed.to,
            alternates: committed.alternates,
            body,
            ticket: committed.ticket,
            health_was_clean: moment.health_was_clean,
            routed_at_ms: moment.routed_at_ms,
            prefill: committed.prefill,
        }
    }
}

/// The route header's value: the chosen worker, then its alternates
/// (`override_host` takes the next one at each retry).
pub fn route_value<'a>(to: &'a Chosen, alternates: &[Chosen]) -> Cow<'a, str> {
    if alternates.is_empty() {
        return Cow::Borrowed(&to.endpoint);
    }
    let mut value = String::from(&*to.endpoint);
    for alt in alternates {
        value.push(',');
        value.push_str(&alt.endpoint);
    }
    Cow::Owned(value)
}

#[derive(Debug, PartialEq, Eq)]
pub enum Decision {
    Route(Routed),
    /// Forwarded untouched (the cluster's fallback policy picks the host).
    PassThrough {
        reason: PassReason,
        /// The body with untrusted client rank fields neutralised, if it had any.
        body: Option<Vec<u8>>,
    },
    /// PD mode: send `prefill_body` to the prefill worker, forward the decode body.
    Pd(PdRouted),
    /// Answered by dprank itself.
    Reject {
        reason: RejectReason,
        reply: Reply,
    },
    /// Admission: every candidate is saturated; nothing was chosen or
    /// written. The lifecycle refuses or holds the request by its class.
    Overloaded(Overload),
}

/// Admission now, as a request would find it: the overload if every
/// candidate is saturated (None otherwise, or without admission), and how
/// many candidate ranks are saturated.
pub fn overload_now(config: &Rc<Config>, host: &dyn Host, cache: &mut StateCache) -> (Option<Overload>, u64) {
    if config.admission.is_none() {
        return (None, 0);
    }
    let snapshot = snapshot::refresh(config, host, cache, 0);
    let overload = match admission::judge(&snapshot, None) {
        crate::worker_state::saturation::Judgement::Saturated {
            ranks,
            retry_after_ms,
        } => Some(Overload {
            retry_after_ms,
            saturated_ranks: ranks,
        }),
        _ => None,
    };
    (overload, admission::saturated_ranks(&snapshot))
}

/// Under prefix affinity, the request's prefill is over: its first response
/// byte came (streamed), or it ended. `config` is the one it was routed with.
pub fn prefill_started(config: &Rc<Config>, host: &dyn Host, cache: &mut StateCache, ticket: &PrefillTicket) {
    cache.write_as_routed(config, host, ticket.worker, |state| {
        state.prefill_started(ticket);
        Some(())
    });
}

/// Gives back a routed request's estimate when its stream ends (and, under
/// prefix affinity, its prefill charge when no response byte came first);
/// `config` is the one it was routed with.
pub fn release(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    ticket: &Ticket,
    prefill: Option<&PrefillTicket>,
) {
    if prefill.is_none() && cache.counted_by_snapshot(config, ticket) {
        // A snapshot counted the request: nothing is left to give back.
        return;
    }
    cache.write_as_routed(config, host, ticket.worker, |state| {
        let released = state.release(ticket);
        match prefill {
            Some(prefill) => {
                state.prefill_started(prefill);
                Some(())
            }
            None => released.then_some(()),
        }
    });
}

#[cfg(test)]
mod affinity_tests;
#[cfg(test)]
mod tests;
