//! Body mode (`rank_transport: body`, the default): the choice made once
//! the whole JSON body is buffered, the chosen rank written into it (a
//! buffered body under header mode goes to `by_header.rs`). What
//! differs from the other paths: the cost comes from the body, prefix
//! affinity applies, a trusted client's rank constrains the choice, and a
//! request that cannot be routed keeps no client rank field.

use super::body_fields::{
    client_rank, estimated_tokens, prefix_request, queue_charge, server_priority, with_priority,
};
use super::outcome::{pass, pass_or_reject, reject, PassReason, RejectReason};
use super::pipeline::{self, Leg, RouteArgs};
use super::snapshot::{Side, Snapshot};
use super::{by_header, pd, Decision, Routed};
use crate::body::{may_name_a_rank, BodyError, JsonObject};
use crate::config::Config;
use crate::host::Host;
use crate::scheduler::Constraint;
use crate::shared_data::cache::StateCache;
use std::rc::Rc;

/// Decides where a request with this body goes. `cache` is this VM's copy
/// of the workers' states and health record (read here). `pin` is the
/// test-only pin header (already None unless the config enables it).
/// `tie_breaker` varies per request so equal loads spread. Admission
/// judges it as the default class (`route_with` says otherwise).
pub fn route(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    body: &[u8],
    pin: Option<&str>,
    tie_breaker: u64,
) -> Decision {
    let args = RouteArgs {
        pin,
        tie_breaker,
        class: None,
    };
    route_with(config, host, cache, body, &args)
}

/// `route`, with everything the lifecycle knows of the request in `args`.
pub fn route_with(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    body: &[u8],
    args: &RouteArgs,
) -> Decision {
    let pin = args.pin;
    if let Some(pd) = config.pd() {
        return pd::route_pd(config, pd, host, cache, body, args);
    }
    if body.is_empty() {
        // A chunked or HTTP/2 request whose body turned out empty.
        return pass(host, PassReason::EmptyBody, None);
    }
    if let Some(settings) = config.header_transport() {
        return by_header::route_by_prompt(config, settings, host, cache, body, args);
    }
    let object = match JsonObject::parse(body) {
        Ok(object) => object,
        Err(e) => return unreadable(config, host, body, e),
    };
    let trusted_rank = config
        .keep_client_rank
        .then(|| client_rank(config, &object))
        .flatten();
    let snapshot = match pipeline::start(config, host, cache, args) {
        Ok(snapshot) => snapshot,
        Err(refused) => return refused.into(),
    };
    let mut prefix = prefix_request(config, &object, snapshot.now_ms);
    let leg = Leg {
        side: Side::Routed,
        constraint: Constraint {
            only_rank: trusted_rank,
            pin,
        },
        alternates: config.retry_alternates as usize,
    };
    let Some(choice) = pipeline::choose(host, &snapshot, &leg, prefix.as_mut()) else {
        return no_candidate(config, host, &snapshot, &object, trusted_rank);
    };
    let moment = snapshot.moment();
    let cost = estimated_tokens(config, &object, prefix.as_ref());
    let queued = queue_charge(config, &object, prefix.as_ref());
    let committed = pipeline::commit(config, host, cache, &choice, cost, prefix.as_mut(), queued);
    // Stage `reply`: the rank goes into the body, unless the client's own
    // stays; so does the server priority, if any.
    // No value (an unpinned worker): the client's rank fields are still
    // neutralised, and the worker's own balancer picks.
    let (mut set, mut neutralise) = match trusted_rank {
        None => (
            committed
                .to
                .value
                .map(|v| vec![(config.rank_field.as_str(), v.to_string())])
                .unwrap_or_default(),
            config.rank_field_names(),
        ),
        Some(_) => (Vec::new(), Vec::new()),
    };
    with_priority(server_priority(config, args.class), &mut set, &mut neutralise);
    let body = (!neutralise.is_empty()).then(|| object.rewritten(&set, &neutralise));
    Decision::Route(Routed::new(committed, moment, body))
}

/// A body that is no JSON object: one that is not JSON but names a rank is
/// refused (a lenient server parser could honour it); the rest pass, or are
/// refused in closed mode.
fn unreadable(config: &Config, host: &dyn Host, body: &[u8], e: BodyError) -> Decision {
    let reason = PassReason::from(e);
    if reason == PassReason::NotJson
        && !config.keep_client_rank
        && may_name_a_rank(body, &config.rank_field_names())
    {
        let refusal = RejectReason::UnreadableRank;
        return reject(host, refusal, refusal.reply());
    }
    pass_or_reject(config, host, reason, None)
}

/// No candidate: a trusted client's rank nobody fresh has, or why nobody
/// could be chosen; the body passes with any client rank field neutralised.
fn no_candidate(
    config: &Config,
    host: &dyn Host,
    snapshot: &Snapshot,
    object: &JsonObject,
    trusted_rank: Option<u32>,
) -> Decision {
    let anyone = Leg {
        side: Side::Routed,
        constraint: Constraint::default(),
        alternates: 0,
    };
    if trusted_rank.is_some() && pipeline::choose(host, snapshot, &anyone, None).is_some() {
        return pass_or_reject(config, host, PassReason::ClientRankUnavailable, None);
    }
    let rank_names = config.rank_field_names();
    let neutralised =
        (trusted_rank.is_none() && object.has_any(&rank_names)).then(|| object.rewritten(&[], &rank_names));
    let reason = pipeline::no_candidate_reason(snapshot, Side::Routed);
    pass_or_reject(config, host, reason, neutralised)
}
