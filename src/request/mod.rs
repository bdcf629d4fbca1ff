//! One request's life in the filter, as plain Rust behind the `Host` trait:
//! [`Request`], a method per Envoy callback (`filter.rs` only translates
//! them), handing the request to small tasks, a file each: `route.rs`
//! (admission's one call around the router, the decision applied),
//! `held.rs` and `passes.rs` (holding, and the passes that let held
//! requests in), `prefill.rs` (PD's prefill leg), `rank_refusal.rs` (the
//! answer watched for a refused rank value), `teardown.rs` (what the
//! request owes, paid once each); `routing.rs` is what a VM's requests share.

mod delivery;
mod held;
mod passes;
mod prefill;
mod rank_refusal;
mod route;
mod routing;
mod teardown;

pub use held::{queue_tick_period_ms, Held};
pub use passes::{drain_held, let_in, on_admission_tick, on_root_callout};
pub use routing::Routing;

use crate::admission::Applicant;
use crate::config::Config;
use crate::host::{HeaderMap, Host, HostError};
use crate::router::{self, Decision, PassReason, RejectReason};
use delivery::Delivery;
use held::Admitting;
use prefill::PrefillLeg;
use rank_refusal::RankWatch;
use std::cell::RefCell;
use std::rc::{Rc, Weak};
use teardown::Owed;

/// What Envoy should do after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    /// Stop iteration: wait for more body, for the prefill leg, or a local reply was sent.
    Pause,
}

pub struct Request {
    routing: Rc<Routing>,
    /// Envoy's id of this request's context (0: one that is never held).
    id: u32,
    /// The request itself, for the queue (empty: never held).
    me: Weak<RefCell<Request>>,
    /// The configuration this request is routed (and what it owes paid) with.
    config: Rc<Config>,
    /// The request as its headers and body arrived: what routing is given.
    arrival: Arrival,
    /// Admission on: who asks, and its stay in the queue.
    admitting: Option<Admitting>,
    /// PD mode: the prefill leg.
    prefill: PrefillLeg,
    /// The rank value written for it, watched in its answer.
    rank_watch: RankWatch,
    /// What its rank delivered, timed as the answer streams through.
    delivery: Delivery,
    /// What it gives back, and where it went.
    owed: Owed,
}

/// A request as its headers and body arrived: what routing is given.
#[derive(Debug, Default)]
struct Arrival {
    /// The body will be read and routed.
    will_route: bool,
    /// The decision is made on the body (body mode, and header mode under
    /// prefix affinity), not on the headers alone.
    routes_on_body: bool,
    /// Bytes buffered so far.
    body_size: usize,
    had_content_length: bool,
    /// Header mode: the cost the headers gave, to route it later.
    header_cost: u64,
    /// The test-only pin header's value.
    pin: Option<String>,
}

impl Request {
    pub fn new(routing: Rc<Routing>) -> Request {
        // Headers-time decisions need only the configuration as written.
        let config = routing.base();
        Request {
            routing,
            id: 0,
            me: Weak::new(),
            config,
            arrival: Arrival::default(),
            admitting: None,
            prefill: PrefillLeg::default(),
            rank_watch: RankWatch::default(),
            delivery: Delivery::default(),
            owed: Owed::default(),
        }
    }

    /// A request that admission may hold: Envoy's context `id`, shared
    /// with this thread's queue while it waits.
    pub fn shared(routing: Rc<Routing>, id: u32) -> Rc<RefCell<Request>> {
        Rc::new_cyclic(|me| {
            let mut request = Request::new(routing);
            request.id = id;
            request.me = me.clone();
            RefCell::new(request)
        })
    }

    pub fn on_request_headers(&mut self, host: &dyn Host, end_of_stream: bool) -> Action {
        let config = self.config.clone();
        let headers = match host.request_headers() {
            Ok(headers) => headers,
            Err(e) => return self.host_refused(host, "headers", e),
        };
        // Routing and rank headers are the filter's alone: a client value would steer traffic.
        if let Err(e) = remove_client_headers(&config, host, &headers) {
            // One the client could steer with stays: refused, never forwarded.
            log::warn!("cannot remove a client header only dprank may set: {e}; request refused");
            RejectReason::HostRefused.reply().send(host);
            return Action::Pause;
        }
        if let Some(pin_header) = &config.pin_header {
            self.arrival.pin = headers.get(pin_header).map(str::to_string);
        }
        if let Some(reason) = pass_reason(&config, &headers, end_of_stream) {
            router::pass_early(host, reason);
            return Action::Continue;
        }
        if let Some(settings) = &config.admission {
            self.admitting = Some(Admitting::new(Applicant::of(settings, &headers)));
        }
        if let Some(settings) = config.header_transport() {
            // A compressed body cannot be read for its prompt: routed by load
            // from the headers, as header mode without prefix affinity does.
            if !settings.reads_body || encoded(&headers) {
                self.arrival.header_cost =
                    router::cost_from_length(&config, settings, headers.content_length());
                return route::route(self, host);
            }
        }
        self.arrival.will_route = true;
        self.arrival.routes_on_body = true;
        self.arrival.had_content_length = headers.contains("content-length");
        Action::Pause
    }

    /// Whether admission holds this request now.
    pub fn is_held(&self) -> bool {
        self.admitting.is_some_and(|a| a.is_held())
    }

    pub fn on_request_body(&mut self, host: &dyn Host, body_size: usize, end_of_stream: bool) -> Action {
        if self.is_held() {
            // Header mode: the body waits with the headers (Envoy buffers it).
            return Action::Pause;
        }
        if !self.arrival.will_route {
            return Action::Continue;
        }
        self.arrival.body_size = body_size;
        if !end_of_stream {
            return Action::Pause;
        }
        self.route_body(host)
    }

    pub fn on_request_trailers(&mut self, host: &dyn Host) -> Action {
        if self.is_held() {
            return Action::Pause;
        }
        // A body followed by trailers never sees end_of_stream in the body callback.
        if self.arrival.will_route {
            return self.route_body(host);
        }
        Action::Continue
    }

    /// The whole body is buffered: it is routed, once.
    fn route_body(&mut self, host: &dyn Host) -> Action {
        self.arrival.will_route = false;
        route::route(self, host)
    }

    /// The prefill leg answered (or failed: no headers).
    pub fn on_prefill_response(&mut self, host: &dyn Host, headers: usize, body_size: usize) {
        let answer = host.callout_response(headers, body_size);
        prefill::on_answer(self, host, &answer);
    }

    pub fn on_response_headers(&mut self, host: &dyn Host) -> Action {
        if self.rank_watch.is_watching() || self.delivery.wants_headers() {
            let status = host.response_status().ok().flatten();
            self.rank_watch.on_response_headers(host, status);
            self.delivery.on_response_headers(host, status);
        }
        self.prefill.on_response_headers(host)
    }

    /// A chunk of the response body (`body_size` bytes). The first one of a
    /// streamed response carries the first token: the request's prefill is
    /// over. The first of a 400 is read for a refusal of the rank value.
    pub fn on_response_body(&mut self, host: &dyn Host, body_size: usize) -> Action {
        self.owed
            .first_byte(&self.config, host, &mut self.routing.states.borrow_mut());
        self.rank_watch.on_response_body(&self.config, host, body_size);
        let seen = self.delivery.on_response_body(host, body_size);
        delivery::keep(&self.routing, &self.config, seen);
        self.prefill.on_response_body()
    }

    /// The request is over (completed, reset or refused): one still held
    /// gives up its place (its client went away), what it owes is paid and
    /// how it went counts for its workers' health; what it held may be room
    /// for a held request now.
    pub fn on_done(&mut self, host: &dyn Host) {
        held::leave_if_held(self, host);
        let seen = self.delivery.on_done(&self.config, host);
        delivery::keep(&self.routing, &self.config, seen);
        self.owed
            .settle(&self.config, host, &mut self.routing.states.borrow_mut());
        let queues = self.config.admission.as_ref().is_some_and(|a| a.queues());
        if queues && self.id != 0 && !self.routing.held.is_empty() {
            passes::let_in(&self.routing, host, self.id, false);
        }
    }

    /// The proxy refused to hand over the request's `part`: passed on
    /// unrouted, or refused in closed mode.
    fn host_refused(&mut self, host: &dyn Host, part: &str, e: HostError) -> Action {
        log::warn!("cannot read a request's {part}: {e}");
        match router::pass_or_reject(&self.config, host, PassReason::HostRefused, None) {
            Decision::Reject { reply, .. } => {
                reply.send(host);
                Action::Pause
            }
            _ => Action::Continue,
        }
    }
}

/// Removes the client headers only dprank may set (`Config::removed_headers`),
/// those present only: a removal is a host call.
fn remove_client_headers(config: &Config, host: &dyn Host, headers: &HeaderMap) -> Result<(), HostError> {
    for (name, _) in headers.iter() {
        if let Some(removed) = config.removed_headers.iter().find(|r| r.as_bytes() == name) {
            host.remove_request_header(removed)?;
        }
    }
    Ok(())
}

/// Whether the body is compressed (unreadable without decompressing it).
fn encoded(headers: &HeaderMap) -> bool {
    headers
        .get_bytes("content-encoding")
        .is_some_and(|e| !e.eq_ignore_ascii_case(b"identity"))
}

/// Why a request is not routed, as far as its headers tell.
fn pass_reason(config: &Config, headers: &HeaderMap, end_of_stream: bool) -> Option<PassReason> {
    let header_mode = config.header_transport().is_some();
    if headers.get_bytes(":method") != Some(b"POST") {
        Some(PassReason::Method)
    } else if !headers.get(":path").is_some_and(|p| config.routes_path(p)) {
        Some(PassReason::Path)
    } else if !header_mode && encoded(headers) {
        // The body would have to be decompressed; header mode routes it by load.
        Some(PassReason::Encoded)
    } else if end_of_stream || headers.content_length() == Some(0) {
        Some(PassReason::EmptyBody)
    } else {
        None
    }
}

#[cfg(test)]
mod held_tests;
#[cfg(test)]
mod tests;
