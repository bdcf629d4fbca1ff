//! The routing task: a request's one call to admission around the router
//! (its body once buffered, or what its headers told), and the decision
//! applied: the route header and, in header mode, the rank headers; the
//! rewritten body and its `content-length`; a local reply; PD's decode leg
//! once its prefill leg is sent (`prefill.rs`). What the request owes from
//! then on is `teardown.rs`'s.

use super::delivery::AtRouting;
use super::held::{self, Left};
use super::prefill;
use super::{Action, Request};
use crate::admission::{Controller, Overloaded, Verdict};
use crate::headers::SERVER_PRIORITY_HEADER;
use crate::host::Host;
use crate::metrics::{self, AdmissionEvent, HostCall};
use crate::router::{self, route_value, Decision, Input, PassReason, RouteArgs, Routed};
use crate::shared_data::cache::StateCache;
use crate::worker_state::saturation::expected_wait_ms;

/// Routes the request and applies the decision, or holds or refuses it
/// when admission keeps it out.
pub(super) fn route(req: &mut Request, host: &dyn Host) -> Action {
    let config = req.config.clone();
    let admission = Controller::new(config.admission.as_ref());
    let applicant = req.admitting.map(|a| a.applicant);
    let held_ahead = req.routing.held.highest();
    match admission.admit(applicant.as_ref(), held_ahead, || decide(req, host)) {
        Verdict::Admitted(decision) => {
            if let Some(a) = applicant {
                admission.count(host, AdmissionEvent::Admitted, a.class);
            }
            apply(req, host, decision)
        }
        Verdict::Refused {
            refusal,
            retry_after_ms,
        } => held::refuse(req, host, refusal, retry_after_ms),
        Verdict::Held { retry_after_ms } => held::hold(req, host, retry_after_ms),
    }
}

/// A held request's turn (it is on the effective context, out of the
/// queue): routed if there is room now (Some: what Envoy should do), else
/// it stays first in line (None). Nobody is ahead of it.
pub(super) fn resume(req: &mut Request, host: &dyn Host) -> Option<Action> {
    let config = req.config.clone();
    let admission = Controller::new(config.admission.as_ref());
    let applicant = req.admitting.map(|a| a.applicant);
    match admission.admit(applicant.as_ref(), None, || decide(req, host)) {
        Verdict::Admitted(decision) => {
            held::leave_queue(req, host, Left::Admitted);
            if let Some(a) = applicant {
                admission.count(host, AdmissionEvent::Admitted, a.class);
            }
            Some(apply(req, host, decision))
        }
        Verdict::Refused { .. } | Verdict::Held { .. } => None,
    }
}

/// The router's decision, on the body or on the headers (Err: every
/// candidate is saturated).
pub(super) fn decide(req: &mut Request, host: &dyn Host) -> Result<Decision, Overloaded> {
    req.config = req.routing.current(host);
    let body = match req.arrival.routes_on_body {
        true => match host.request_body(req.arrival.body_size) {
            Ok(body) => Some(body),
            Err(e) => {
                log::warn!("cannot read a request body: {e}; passed on unrouted");
                return Ok(router::pass_or_reject(
                    &req.config,
                    host,
                    PassReason::HostRefused,
                    None,
                ));
            }
        },
        false => None,
    };
    let input = match &body {
        Some(body) => Input::Body(body),
        None => Input::Headers {
            cost: req.arrival.header_cost,
        },
    };
    let args = RouteArgs {
        pin: req.arrival.pin.as_deref(),
        tie_breaker: req.routing.next_tie_breaker(),
        class: req.admitting.map(|a| a.applicant.class),
    };
    router::route(
        &req.config,
        host,
        &mut req.routing.states.borrow_mut(),
        input,
        &args,
    )
}

/// Applies the router's decision.
pub(super) fn apply(req: &mut Request, host: &dyn Host, decision: Decision) -> Action {
    match decision {
        Decision::Route(routed) => {
            apply_routed(req, host, &routed);
            if let Some(new_body) = &routed.body {
                replace_body(req, host, new_body);
            }
            req.owed.routed(routed.estimate, routed.queued_prefill);
            Action::Continue
        }
        Decision::Pd(pd) => {
            req.owed
                .routed_pd(pd.decode_estimate, pd.prefill_estimate, pd.queued_prefill);
            if !prefill::start(req, host, &pd) {
                return Action::Pause;
            }
            if let Some(decode) = &pd.decode {
                set_header(
                    host,
                    &req.config.route_header,
                    &route_value(decode, &pd.decode_alternates),
                );
            }
            replace_body(req, host, &pd.decode_body);
            let rank = pd.decode.as_ref().and_then(|d| d.rank);
            req.owed.sent_to(
                &req.config,
                pd.decode.iter().chain(&pd.decode_alternates),
                rank,
                pd.health_was_clean,
                pd.routed_at_ms,
            );
            Action::Continue
        }
        Decision::PassThrough { body: new_body, .. } => {
            if let Some(new_body) = &new_body {
                replace_body(req, host, new_body);
            }
            req.owed.sent_to_fallback(&req.config, host);
            Action::Continue
        }
        Decision::Reject { reply, .. } => {
            reply.send(host);
            Action::Pause
        }
    }
}

/// Applies a routed decision's headers (the route header; in header
/// mode the rank headers, which hold for every retry since the
/// alternates have the same rank, and the class's server priority)
/// and remembers where it went.
fn apply_routed(req: &mut Request, host: &dyn Host, routed: &Routed) {
    set_header(
        host,
        &req.config.route_header,
        &route_value(&routed.chosen, &routed.alternates),
    );
    if let Some(settings) = req.config.header_transport() {
        let mut digits = itoa::Buffer::new();
        if let Some(value) = routed.chosen.value {
            let value = digits.format(value);
            for name in &settings.rank_headers {
                set_header(host, name, value);
            }
        }
        let class = req.admitting.map(|a| a.applicant.class);
        if let Some(Some(priority)) = router::server_priority(&req.config, class) {
            set_header(host, SERVER_PRIORITY_HEADER, digits.format(priority));
        }
    }
    req.owed.sent_to(
        &req.config,
        std::iter::once(&routed.chosen).chain(&routed.alternates),
        routed.chosen.rank,
        routed.health_was_clean,
        routed.routed_at_ms,
    );
    req.rank_watch.watch(&routed.chosen);
    if let (true, Some(rank)) = (req.config.delivery_timing, routed.chosen.rank) {
        let worker = routed.chosen.worker;
        let states = req.routing.states.borrow();
        let first = states.first_rank(worker);
        let at_routing = at_routing(req, &states, worker, rank as usize);
        drop(states);
        req.delivery.watch(
            worker,
            (rank as usize, first.saturating_add(rank)),
            routed.routed_at_ms,
            at_routing,
        );
    }
}

/// With SLO admission, the chosen rank's queue as the request joined it
/// (its own prompt and estimate in it): what its answer is judged against.
fn at_routing(req: &Request, states: &StateCache, worker: usize, rank: usize) -> Option<AtRouting> {
    let settings = req.config.admission.as_ref().filter(|a| a.slo.is_some())?;
    let class = req.admitting.map(|a| a.applicant.class);
    let rule = Controller::new(Some(settings)).rule(class)?;
    let state = states.states().get(worker)?.as_ref()?;
    // One pass over the worker's ranks: their requests summed (None if one
    // does not count them), the chosen rank's wait read on the way.
    let mut in_flight = Some(0u64);
    let mut predicted_wait_ms = None;
    for r in 0..state.ranks() {
        let queue = rule.queue(state, r);
        in_flight = in_flight
            .zip(queue.in_flight)
            .map(|(sum, n)| sum.saturating_add(n));
        if r == rank {
            predicted_wait_ms = Some(expected_wait_ms(&queue));
        }
    }
    Some(AtRouting {
        predicted_wait_ms: predicted_wait_ms.unwrap_or_else(|| expected_wait_ms(&rule.queue(state, rank))),
        in_flight,
    })
}

/// Envoy does not correct `content-length` after a body change: dprank
/// does. A body the proxy will not replace goes on as the client sent it.
fn replace_body(req: &Request, host: &dyn Host, body: &[u8]) {
    match host.replace_request_body(req.arrival.body_size, body) {
        Ok(()) if req.arrival.had_content_length => {
            set_header(host, "content-length", itoa::Buffer::new().format(body.len()));
        }
        Ok(()) => {}
        Err(_) => host.count(&metrics::host_refused(HostCall::ReplaceBody), 1),
    }
}

/// Sets a request header; one the proxy refuses is left out and counted
/// (the route header: the cluster's fallback policy picks the host).
fn set_header(host: &dyn Host, name: &str, value: &str) {
    if host.set_request_header(name, value).is_err() {
        host.count(&metrics::host_refused(HostCall::SetHeader), 1);
    }
}
