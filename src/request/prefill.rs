//! PD's prefill leg, as the request lifecycle runs it: the call sent to
//! the prefill worker the router chose (its body carries the bootstrap
//! fields), the decode response held until the prefill leg has answered,
//! and what its answer means: for the client (a failed prefill is answered
//! at once, the decode side would wait for a KV cache that never comes),
//! for passive health, and for its worker's rotation.

use super::{Action, Request};
use crate::config::Config;
use crate::health::{classify, targets, Outcome};
use crate::health_updates;
use crate::host::{Callout, CalloutError, CalloutResponse, Host};
use crate::metrics::{self, HostCall, PerWorker};
use crate::poller::POLL_DESTINATION_HEADER;
use crate::reply::Reply;
use crate::router::PdRouted;
use crate::shared_data::{self, IfMissing};

/// Client headers the prefill leg carries too (auth and tracing).
const PREFILL_FORWARDED_HEADERS: [&str; 4] = ["authorization", "x-request-id", "traceparent", "tracestate"];

/// The prefill leg of a PD request.
#[derive(Debug, Default)]
pub(super) struct PrefillLeg {
    state: State,
    /// The token of its call, while it runs.
    token: Option<u32>,
    /// The decode response headers wait for it.
    response_held: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
enum State {
    /// Regular mode, or not dispatched.
    #[default]
    None,
    Pending {
        worker: usize,
        rank: Option<u32>,
    },
    Done,
    Failed(Reply),
}

impl PrefillLeg {
    /// The token of its call while it runs (a root pass that let the
    /// request in receives its answer).
    pub fn token(&self) -> Option<u32> {
        self.token
    }

    /// The decode response's headers: held while the prefill leg runs, or
    /// answered with its failure.
    pub fn on_response_headers(&mut self, host: &dyn Host) -> Action {
        match &self.state {
            State::Pending { .. } => {
                self.response_held = true;
                Action::Pause
            }
            State::Failed(reply) => {
                reply.send(host);
                Action::Pause
            }
            State::None | State::Done => Action::Continue,
        }
    }

    /// A chunk of the decode response's body: continuing while its headers
    /// are held would release them with the body.
    pub fn on_response_body(&self) -> Action {
        if self.response_held {
            Action::Pause
        } else {
            Action::Continue
        }
    }
}

/// Sends the prefill leg; one Envoy refuses to dispatch ends the request
/// with an answer at once (false).
pub(super) fn start(req: &mut Request, host: &dyn Host, pd: &PdRouted) -> bool {
    if dispatch(req, host, pd) {
        return true;
    }
    req.on_done(host);
    prefill_not_sent(&req.config, host, pd.prefill.worker).send(host);
    false
}

/// Sends the prefill leg; false if Envoy refused to dispatch it.
fn dispatch(req: &mut Request, host: &dyn Host, pd: &PdRouted) -> bool {
    let Some(settings) = req.config.pd() else {
        return false;
    };
    // Unreadable headers leave no path: Envoy refuses the call, answered 502.
    let client = host.request_headers().unwrap_or_default();
    let path = client.get(":path").unwrap_or_default();
    let forwarded: Vec<(&str, &str)> = PREFILL_FORWARDED_HEADERS
        .iter()
        .filter_map(|h| client.get(h).map(|v| (*h, v)))
        .collect();
    let endpoint: &str = &pd.prefill.endpoint;
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", endpoint),
        (POLL_DESTINATION_HEADER, endpoint),
        ("content-type", "application/json"),
    ];
    headers.extend(forwarded);
    let call = Callout {
        cluster: &settings.cluster,
        headers: &headers,
        body: Some(&pd.prefill_body),
        timeout_ms: settings.timeout_ms,
    };
    match host.http_call(&call) {
        Ok(token) => {
            req.prefill.token = Some(token);
            req.prefill.state = State::Pending {
                worker: pd.prefill.worker,
                rank: pd.prefill.rank,
            };
            true
        }
        Err(e) => {
            log::warn!("prefill call to {endpoint} not dispatched ({e}): is the prefill cluster defined?");
            false
        }
    }
}

/// The prefill leg's answer, read, or why there is none: its estimate
/// goes back, passive health hears of it, and the decode response goes
/// on, or the client gets the failure.
pub(super) fn on_answer(req: &mut Request, host: &dyn Host, answer: &Result<CalloutResponse, CalloutError>) {
    let (status, body) = match answer {
        Ok(r) => (Some(r.status), r.body.as_slice()),
        Err(e) => {
            log::debug!("prefill leg: {e}");
            (None, &[][..])
        }
    };
    let State::Pending { worker, rank } = req.prefill.state else {
        return;
    };
    req.prefill.token = None;
    req.owed
        .prefill_leg_answered(&req.config, host, &mut req.routing.states.borrow_mut());
    let routed_at_ms = req.owed.routed_at_ms();
    prefill_health(&req.config, host, worker, rank, status, routed_at_ms);
    match prefill_outcome(&req.config, host, worker, status, body) {
        None => {
            req.prefill.state = State::Done;
            if req.prefill.response_held {
                req.prefill.response_held = false;
                if host.resume_response().is_err() {
                    // The stream went while it waited: nothing to resume.
                    host.count(&metrics::host_refused(HostCall::ResumeResponse), 1);
                }
            }
        }
        Some(reply) => {
            // The decode side waits for a KV cache that will never come: answer now.
            reply.send(host);
            req.prefill.state = State::Failed(reply);
        }
    }
}

/// What the client gets when the prefill leg ended: None if it succeeded,
/// else the error reply. A prefill that did not answer at all also takes its
/// worker out of rotation until its next good poll.
fn prefill_outcome(
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
fn prefill_health(
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
fn prefill_not_sent(config: &Config, host: &dyn Host, worker: usize) -> Reply {
    let name = config.worker(worker).map(|w| w.name.clone()).unwrap_or_default();
    host.count(&PerWorker::PrefillFailed.of(&name), 1);
    Reply::prefill_not_sent()
}

/// A prefill worker that could not be reached gets no more requests until a
/// poll succeeds again.
fn mark_unreachable(config: &Config, host: &dyn Host, worker: usize) {
    shared_data::update_worker(config, host, worker, IfMissing::Skip, |state| {
        state.mark_unreachable();
        Some(())
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;
    use crate::router::{route, Decision, Input, RouteArgs};
    use crate::shared_data::cache::StateCache;
    use crate::shared_data::read_worker_states;
    use crate::shared_data::testing::*;

    fn prefill_worker(c: &std::rc::Rc<Config>, h: &FakeHost, tie_breaker: u64) -> usize {
        let args = RouteArgs {
            tie_breaker,
            ..RouteArgs::default()
        };
        match route(c, h, &mut StateCache::default(), Input::Body(b"{}"), &args) {
            Ok(Decision::Pd(pd)) => pd.prefill.worker,
            other => panic!("expected PD routing, got {other:?}"),
        }
    }

    #[test]
    fn prefill_outcomes() {
        let (c, h) = pd_fleet("");
        let fresh = |h: &FakeHost| {
            read_worker_states(&c, h)[2]
                .as_ref()
                .unwrap()
                .is_fresh(10_000, c.stale_after_ms)
        };
        assert_eq!(prefill_outcome(&c, &h, 2, Some(200), b"{}"), None);
        assert_eq!(h.counter("dprank.prefill_ok.p0"), 1);
        let Reply { status, body, .. } = prefill_outcome(&c, &h, 2, Some(500), b"internal").unwrap();
        assert_eq!(status, 502);
        assert!(body.contains("500") && body.contains("internal"));
        assert_eq!(json(body.as_bytes())["error"]["type"], "prefill_failed");
        assert_eq!(
            prefill_outcome(&c, &h, 2, Some(400), b"too long").unwrap().status,
            400
        );
        assert!(fresh(&h), "an answering worker stays in rotation");
        assert_eq!(prefill_outcome(&c, &h, 2, None, b"").unwrap().status, 502);
        assert!(!fresh(&h));
        poll(&c, &h, 2, &[9, 1]);
        assert!(fresh(&h), "a good poll brings it back");
        let Reply { status, body, .. } =
            prefill_outcome(&c, &h, 2, Some(503), b"upstream connect error").unwrap();
        assert_eq!(status, 502);
        assert!(body.contains("upstream connect error"));
        assert!(!fresh(&h), "Envoy's own 503 means unreachable");
        // The dead prefill worker gets no more traffic.
        for i in 0..4 {
            assert_eq!(prefill_worker(&c, &h, i), 3);
        }
        assert_eq!(h.counter("dprank.prefill_failed.p0"), 4);
    }
}
