//! Per-request routing: a request in, a [`Decision`] out (or the overload
//! admission keeps it out with). Knows nothing of proxy-wasm; the request
//! lifecycle (`request/`) applies the decision. [`route`] sends a request
//! down its path: body mode (`by_body.rs`), header mode (`by_header.rs`),
//! PD mode (`pd.rs`); each is a [`pipeline::Path`] that one pipeline runs
//! (`pipeline.rs`: refresh, admission, pool, choose, retry targets,
//! account, record, reply). A request not routed is passed through or
//! refused (`outcome.rs`).

mod body_fields;
mod by_body;
mod by_header;
mod outcome;
mod pd;
mod pipeline;
mod snapshot;

pub(crate) use body_fields::server_priority;
pub use body_fields::PRIORITY_FIELD;
pub use by_header::cost_from_length;
pub use outcome::{pass_early, pass_or_reject, PassReason, RejectReason};
pub use pd::PdRouted;
pub use pipeline::RouteArgs;

use crate::admission::{Controller, Overloaded};
use crate::config::Config;
use crate::host::Host;
use crate::reply::Reply;
use crate::shared_data::cache::StateCache;
use crate::worker_state::{PrefillTicket, Ticket};
use pipeline::Committed;
use snapshot::Moment;
use std::borrow::Cow;
use std::rc::Rc;

/// The chosen (worker, rank) of a leg, or one of its retry alternates: the
/// one noun for it from `commit` on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    /// Index in `Config::all_workers`.
    pub worker: usize,
    /// The rank's index among the worker's ranks; None when load data
    /// allowed no choice of rank.
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

/// A request routed in body or header mode.
#[derive(Debug, PartialEq, Eq)]
pub struct Routed {
    pub chosen: Chosen,
    /// Other workers with the same rank, cheapest first, for Envoy's retries.
    pub alternates: Vec<Chosen>,
    /// The rewritten body, or None to keep the client's (a trusted client rank).
    pub body: Option<Vec<u8>>,
    /// The estimate added to the chosen rank, given back when the request
    /// ends; None if accounting could not be written.
    pub estimate: Option<Ticket>,
    /// The health record listed nothing when the request was routed: its
    /// success needs no write.
    pub health_was_clean: bool,
    /// When it was routed (the clock the choice read).
    pub routed_at_ms: u64,
    /// The prompt queued on the chosen rank (prefix affinity, admission),
    /// taken back at the first response byte (or the end).
    pub queued_prefill: Option<PrefillTicket>,
}

impl Routed {
    /// Stage `reply` of body and header mode: a committed leg, routed at
    /// `moment`, with the rewritten body if any.
    fn new(committed: Committed, moment: Moment, body: Option<Vec<u8>>) -> Routed {
        Routed {
            chosen: committed.chosen,
            alternates: committed.alternates,
            body,
            estimate: committed.estimate,
            health_was_clean: moment.health_was_clean,
            routed_at_ms: moment.routed_at_ms,
            queued_prefill: committed.queued_prefill,
        }
    }
}

/// The route header's value: the chosen worker, then its alternates
/// (`override_host` takes the next one at each retry).
pub fn route_value<'a>(chosen: &'a Chosen, alternates: &[Chosen]) -> Cow<'a, str> {
    if alternates.is_empty() {
        return Cow::Borrowed(&chosen.endpoint);
    }
    let mut value = String::from(&*chosen.endpoint);
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
}

/// What the router is given of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input<'b> {
    /// The whole body (body mode, PD mode, header mode under prefix
    /// affinity).
    Body(&'b [u8]),
    /// Header mode from the headers alone: the tokens the request adds to
    /// its rank (from `content-length`).
    Headers { cost: u64 },
}

/// Decides where a request goes, down the path its configuration and
/// `input` call for; `cache` is this VM's copy of the workers' states and
/// health record (read here). Err: admission found the pool overloaded
/// (nothing was chosen or written; the lifecycle refuses or holds it).
pub fn route(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    input: Input,
    args: &RouteArgs,
) -> Result<Decision, Overloaded> {
    let body = match input {
        Input::Headers { cost } => return by_header::route_by_length(config, host, cache, cost, args),
        Input::Body(body) => body,
    };
    if let Some(pd) = config.pd() {
        return pd::route_pd(config, pd, host, cache, body, args);
    }
    if body.is_empty() {
        // A chunked or HTTP/2 request whose body turned out empty.
        return Ok(outcome::pass(host, PassReason::EmptyBody, None));
    }
    match config.header_transport() {
        Some(settings) => by_header::route_by_prompt(config, settings, host, cache, body, args),
        None => by_body::route_body(config, host, cache, body, args),
    }
}

/// Admission now, as a request of the default class would find it: the
/// overload if every candidate is saturated (None otherwise, or without
/// admission), and how many candidate ranks are saturated.
pub fn overloaded_now(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
) -> (Option<Overloaded>, u64) {
    if config.admission.is_none() {
        return (None, 0);
    }
    let admission = Controller::new(config.admission.as_ref());
    let snapshot = snapshot::refresh(config, host, cache, 0);
    let side = snapshot.judged_side();
    let candidates = || snapshot.candidate_queues(side, admission.rule(None));
    let overloaded = match admission.judgement(None, candidates()) {
        crate::admission::Judgement::Overloaded(o) => Some(o),
        _ => None,
    };
    (overloaded, admission.saturated_ranks(candidates()))
}

#[cfg(test)]
mod affinity_tests;
#[cfg(test)]
mod tests;
