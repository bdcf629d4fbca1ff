//! Header mode (`rank_transport: header`): the rank goes in request
//! headers (the lifecycle writes them) and the body is never changed. The
//! choice is made from the headers alone, before any body byte has arrived
//! (the cost from `content-length`, no prefix affinity), or, under prefix
//! affinity, at the end of the body, whose prompt is read as in body mode.
//! What differs from body mode either way: no client rank, no body written,
//! and a body that is no JSON object is the server's to refuse (routed by
//! load).

use super::body_fields::{estimated_tokens, prefix_request, queue_charge};
use super::outcome::pass_or_reject;
use super::pipeline::{self, Leg, Prefill, RouteArgs};
use super::snapshot::{Side, Snapshot};
use super::{Decision, Routed};
use crate::body::JsonObject;
use crate::config::{Config, CostEstimate, HeaderTransport};
use crate::host::Host;
use crate::scheduler::Constraint;
use crate::shared_data::cache::StateCache;
use std::rc::Rc;

/// Tokens a request adds to its rank, from its `content-length` alone:
/// length / 4 (`cost_estimate: bytes`, JSON syntax included), 1 per request
/// (`one`), or the configured default when the length is not known.
pub fn cost_from_length(config: &Config, settings: &HeaderTransport, content_length: Option<u64>) -> u64 {
    match (config.cost_estimate, content_length) {
        (CostEstimate::One, _) => 1,
        (_, Some(length)) => length.div_ceil(4).max(1),
        (_, None) => settings.cost_without_length,
    }
}

/// Decides where a request goes without its body. `cache` is this VM's copy
/// of the workers' states and health record (read here); `pin` the
/// test-only pin header; `cost` the tokens the request adds to its rank
/// until a poll counts it. Alternates get the chosen rank as in body mode:
/// the rank headers travel unchanged with every retry.
pub fn route_by_headers(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    cost: u64,
    pin: Option<&str>,
    tie_breaker: u64,
) -> Decision {
    let args = RouteArgs {
        pin,
        tie_breaker,
        class: None,
    };
    route_by_headers_with(config, host, cache, cost, &args)
}

/// `route_by_headers`, with everything the lifecycle knows of the request
/// in `args`.
pub fn route_by_headers_with(
    config: &Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    cost: u64,
    args: &RouteArgs,
) -> Decision {
    let pin = args.pin;
    let snapshot = match pipeline::start(config, host, cache, args) {
        Ok(snapshot) => snapshot,
        Err(refused) => return refused.into(),
    };
    let Some(choice) = pipeline::choose(host, &snapshot, &leg(config, pin), None) else {
        return no_candidate(config, host, &snapshot);
    };
    let moment = snapshot.moment();
    // Admission's queue: the length is all there is of the prompt; whether
    // the answer streams is not known, so it leaves the queue when a poll
    // counts it (or at its end).
    let queued = config.admission.as_ref().map(|_| Prefill::plain(cost, false));
    let committed = pipeline::commit(config, host, cache, &choice, cost, None, queued);
    Decision::Route(Routed::new(committed, moment, None))
}

/// Header mode under prefix affinity: decides at the end of the (non-empty)
/// body, scoring the prompt it holds as body mode does, and leaves the body
/// as it came. A body that is no JSON object is routed by load, its cost
/// from its length.
pub(super) fn route_by_prompt(
    config: &Rc<Config>,
    settings: &HeaderTransport,
    host: &dyn Host,
    cache: &mut StateCache,
    body: &[u8],
    args: &RouteArgs,
) -> Decision {
    let pin = args.pin;
    let object = JsonObject::parse(body).ok();
    let snapshot = match pipeline::start(config, host, cache, args) {
        Ok(snapshot) => snapshot,
        Err(refused) => return refused.into(),
    };
    let mut prefix = object
        .as_ref()
        .and_then(|o| prefix_request(config, o, snapshot.now_ms));
    let Some(choice) = pipeline::choose(host, &snapshot, &leg(config, pin), prefix.as_mut()) else {
        return no_candidate(config, host, &snapshot);
    };
    let moment = snapshot.moment();
    let cost = match &object {
        Some(object) => estimated_tokens(config, object, prefix.as_ref()),
        None => cost_from_length(config, settings, Some(body.len() as u64)),
    };
    let queued = match &object {
        Some(object) => queue_charge(config, object, prefix.as_ref()),
        None => config.admission.as_ref().map(|_| Prefill::plain(cost, false)),
    };
    let committed = pipeline::commit(config, host, cache, &choice, cost, prefix.as_mut(), queued);
    Decision::Route(Routed::new(committed, moment, None))
}

/// Header mode's leg: the routed pool, a test pin if any, the configured
/// alternates (the rank headers travel unchanged with every retry).
fn leg<'r>(config: &Config, pin: Option<&'r str>) -> Leg<'r> {
    Leg {
        side: Side::Routed,
        constraint: Constraint { only_rank: None, pin },
        alternates: config.retry_alternates as usize,
    }
}

/// Nobody can be chosen: passed on with no rank header (or refused in
/// closed mode), the body untouched.
fn no_candidate(config: &Config, host: &dyn Host, snapshot: &Snapshot) -> Decision {
    let reason = pipeline::no_candidate_reason(snapshot, Side::Routed);
    pass_or_reject(config, host, reason, None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared_data::testing::config;

    #[test]
    fn cost_comes_from_the_length_or_the_default() {
        let c = config(r#","rank_transport":"header","cost_without_length":77"#);
        let h = c.header_transport().unwrap();
        assert_eq!(cost_from_length(&c, h, Some(4001)), 1001);
        assert_eq!(cost_from_length(&c, h, Some(1)), 1);
        assert_eq!(cost_from_length(&c, h, None), 77);
        let one = config(r#","rank_transport":"header","cost_estimate":"one""#);
        assert_eq!(
            cost_from_length(&one, one.header_transport().unwrap(), Some(4001)),
            1
        );
    }
}
