//! One request's life in the filter, as plain Rust behind the `Host` trait:
//! one method per Envoy callback, each returning what Envoy should do next.
//! It strips the headers only dprank may set, decides which requests to
//! route, buffers the body (body mode, and header mode under prefix
//! affinity) or routes at once from the headers (header mode), applies the
//! router's decision (route and rank headers, body and `content-length`,
//! local replies), runs PD mode's prefill leg and holds the decode response
//! until it is done, and gives every estimate back and reports how it went
//! to passive health when the request ends. With
//! admission on, a request every rank is too busy for is refused or held
//! (`held.rs`: this thread's queue, and the passes that let held requests
//! in). `filter.rs` only translates callbacks to it.

mod held;
pub mod held_record;

use crate::config::Config;
use crate::discovery::Membership;
use crate::headers::SERVER_PRIORITY_HEADER;
use crate::health_updates::{self, SentTo};
use crate::host::{Callout, CalloutError, CalloutResponse, HeaderMap, Host, HostError};
use crate::metrics::{self, AdmissionEvent, HostCall};
use crate::poller::POLL_DESTINATION_HEADER;
use crate::router::{
    self, route_value, Chosen, Decision, Overload, PassReason, PdRouted, RejectReason, Reply, Routed,
    Written, REFUSAL_BYTES,
};
use crate::shared_data::cache::StateCache;
use crate::worker_state::{PrefillTicket, Ticket};
pub use held::{queue_tick_period_ms, Held};
use std::cell::{Cell, RefCell};
use std::rc::{Rc, Weak};

/// What Envoy should do after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    /// Stop iteration: wait for more body, for the prefill leg, or a local reply was sent.
    Pause,
}

/// Client headers the prefill leg carries too (auth and tracing).
const PREFILL_FORWARDED_HEADERS: [&str; 4] = ["authorization", "x-request-id", "traceparent", "tracestate"];

/// What every request of one VM shares: the configuration in force, the
/// decoded worker states and health record, and the tie-break sequence.
pub struct Routing {
    membership: RefCell<Membership>,
    states: RefCell<StateCache>,
    tie_breaks: Cell<u64>,
    /// Admission's queue on this thread.
    held: Held,
}

impl Routing {
    /// `seed` starts this VM's tie-break sequence apart from other threads'.
    pub fn new(config: Rc<Config>, seed: u64) -> Routing {
        Routing {
            membership: RefCell::new(Membership::new(config)),
            states: RefCell::new(StateCache::default()),
            tie_breaks: Cell::new(seed),
            held: Held::default(),
        }
    }

    /// This VM's id among those sharing the data (admission's shared record).
    pub fn set_vm(&self, vm: u64) {
        self.held.vm.set(vm);
    }

    /// The configuration with the current cluster membership, if any.
    pub fn current(&self, host: &dyn Host) -> Rc<Config> {
        self.membership.borrow_mut().current(host)
    }

    fn next_tie_breaker(&self) -> u64 {
        let t = self.tie_breaks.get().wrapping_add(1);
        self.tie_breaks.set(t);
        t
    }
}

/// The prefill leg of a PD request.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PrefillLeg {
    /// Regular mode, or not dispatched.
    None,
    Pending {
        worker: usize,
        rank: Option<u32>,
    },
    Done,
    Failed(Reply),
}

/// Admission's view of one request (admission on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Admitting {
    /// Index in the configured classes.
    class: usize,
    /// A hash of the tenant header's value (0: none).
    tenant: u64,
    /// While held: since when (ms).
    held_since: Option<u64>,
    /// While held: its place in the shared record is its own (not given
    /// to a higher class already).
    holds_place: bool,
}

/// What letting a held request in came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Resumed {
    /// Still no room: it stays first in line.
    Overloaded(Overload),
    /// Routed: Envoy should go on with it (`Continue`), or not (a local
    /// reply was sent, or PD's prefill leg runs first).
    Go(Action),
}

pub struct Request {
    routing: Rc<Routing>,
    /// Envoy's id of this request's context (0: one that is never held).
    id: u32,
    /// The request itself, for the queue (empty: never held).
    me: Weak<RefCell<Request>>,
    /// Admission on: the class, tenant and whether it is held.
    admitting: Option<Admitting>,
    /// Header mode: the cost the headers gave, to route it later.
    header_cost: u64,
    /// PD: the token of the prefill leg's call.
    prefill_token: Option<u32>,
    /// The configuration this request is routed (and its estimates released) with.
    config: Rc<Config>,
    /// The body will be read and routed.
    will_route: bool,
    /// The decision is made on the body (body mode, and header mode under
    /// prefix affinity), not on the headers alone.
    routes_on_body: bool,
    /// Bytes buffered so far.
    body_size: usize,
    had_content_length: bool,
    pin: Option<String>,
    ticket: Option<Ticket>,
    prefill_ticket: Option<Ticket>,
    /// Prefix affinity: the prefill charged to the rank, taken back at the
    /// first response byte (or when the prefill leg answers, or at the end).
    prefill_charge: Option<PrefillTicket>,
    prefill: PrefillLeg,
    /// The decode response headers wait for the prefill leg.
    response_held: bool,
    /// Where the request was sent, for passive health and retry stats when it ends.
    sent_to: Option<SentTo>,
    /// The rank value written for it, until its answer shows it was not
    /// refused (a 400 is read for a rank refusal).
    written: Option<Written>,
    /// Its answer is a 400: its first body chunk is read for a rank refusal.
    reads_refusal: bool,
}

impl Request {
    pub fn new(routing: Rc<Routing>) -> Request {
        // Headers-time decisions need only the configuration as written.
        let config = routing.membership.borrow().base();
        Request {
            routing,
            id: 0,
            me: Weak::new(),
            admitting: None,
            header_cost: 0,
            prefill_token: None,
            config,
            will_route: false,
            routes_on_body: false,
            body_size: 0,
            had_content_length: false,
            pin: None,
            ticket: None,
            prefill_ticket: None,
            prefill_charge: None,
            prefill: PrefillLeg::None,
            response_held: false,
            sent_to: None,
            written: None,
            reads_refusal: false,
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
            self.pin = headers.get(pin_header).map(str::to_string);
        }
        if let Some(reason) = pass_reason(&config, &headers, end_of_stream) {
            router::pass_early(host, reason);
            return Action::Continue;
        }
        if let Some(settings) = &config.admission {
            self.admitting = Some(Admitting {
                class: settings.class_of(headers.get(&settings.priority_header)),
                tenant: settings
                    .tenant_header
                    .as_ref()
                    .and_then(|h| headers.get_bytes(h))
                    .map_or(0, tenant_key),
                held_since: None,
                holds_place: false,
            });
        }
        if let Some(settings) = config.header_transport() {
            // A compressed body cannot be read for its prompt: routed by load
            // from the headers, as header mode without prefix affinity does.
            if !settings.reads_body || encoded(&headers) {
                self.header_cost = router::cost_from_length(&config, settings, headers.content_length());
                return self.route_by_headers(host);
            }
        }
        self.will_route = true;
        self.routes_on_body = true;
        self.had_content_length = headers.contains("content-length");
        Action::Pause
    }

    /// Whether admission holds this request now.
    pub fn is_held(&self) -> bool {
        self.admitting.is_some_and(|a| a.held_since.is_some())
    }

    pub fn on_request_body(&mut self, host: &dyn Host, body_size: usize, end_of_stream: bool) -> Action {
        if self.is_held() {
            // Header mode: the body waits with the headers (Envoy buffers it).
            return Action::Pause;
        }
        if !self.will_route {
            return Action::Continue;
        }
        self.body_size = body_size;
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
        if self.will_route {
            return self.route_body(host);
        }
        Action::Continue
    }

    /// The prefill leg answered (or failed: no headers).
    pub fn on_prefill_response(&mut self, host: &dyn Host, headers: usize, body_size: usize) {
        let answer = host.callout_response(headers, body_size);
        self.on_prefill_answer(host, &answer);
    }

    /// The prefill leg's answer, read, or why there is none.
    pub fn on_prefill_answer(&mut self, host: &dyn Host, answer: &Result<CalloutResponse, CalloutError>) {
        let (status, body) = match answer {
            Ok(r) => (Some(r.status), r.body.as_slice()),
            Err(e) => {
                log::debug!("prefill leg: {e}");
                (None, &[][..])
            }
        };
        let PrefillLeg::Pending { worker, rank } = self.prefill else {
            return;
        };
        self.prefill_token = None;
        if let Some(ticket) = self.prefill_ticket.take() {
            let charge = self.prefill_charge.take();
            router::release(
                &self.config,
                host,
                &mut self.routing.states.borrow_mut(),
                &ticket,
                charge.as_ref(),
            );
        }
        let routed_at_ms = self.sent_to.as_ref().map_or(0, |w| w.routed_at_ms);
        router::prefill_health(&self.config, host, worker, rank, status, routed_at_ms);
        match router::prefill_outcome(&self.config, host, worker, status, body) {
            None => {
                self.prefill = PrefillLeg::Done;
                if self.response_held {
                    self.response_held = false;
                    if host.resume_response().is_err() {
                        // The stream went while it waited: nothing to resume.
                        host.count(&metrics::host_refused(HostCall::ResumeResponse), 1);
                    }
                }
            }
            Some(reply) => {
                // The decode side waits for a KV cache that will never come: answer now.
                reply.send(host);
                self.prefill = PrefillLeg::Failed(reply);
            }
        }
    }

    pub fn on_response_headers(&mut self, host: &dyn Host) -> Action {
        if let Some(written) = &self.written {
            // Only a 400 can refuse the rank value written, and only from
            // the host it was written for (not a retry's).
            self.reads_refusal = matches!(host.response_status(), Ok(Some(400)))
                && host
                    .property(&["upstream", "address"])
                    .ok()
                    .flatten()
                    .is_some_and(|a| a == written.endpoint.as_bytes());
            if !self.reads_refusal {
                self.written = None;
            }
        }
        match &self.prefill {
            PrefillLeg::Pending { .. } => {
                self.response_held = true;
                Action::Pause
            }
            PrefillLeg::Failed(reply) => {
                reply.send(host);
                Action::Pause
            }
            PrefillLeg::None | PrefillLeg::Done => Action::Continue,
        }
    }

    /// A chunk of the response body (`body_size` bytes). The first one of a
    /// streamed response carries the first token: the request's prefill is
    /// over. The first of a 400 is read for a refusal of the rank value.
    pub fn on_response_body(&mut self, host: &dyn Host, body_size: usize) -> Action {
        self.prefill_over(host);
        if std::mem::take(&mut self.reads_refusal) {
            if let (Some(written), Ok(body)) = (
                self.written.take(),
                host.response_body(body_size.min(REFUSAL_BYTES)),
            ) {
                router::rank_refused(&self.config, host, written, &body);
            }
        }
        // Continuing here would release the held headers with the body.
        if self.response_held {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    /// Takes the request's prefill off its rank's queue, once.
    fn prefill_over(&mut self, host: &dyn Host) {
        if let Some(charge) = self.prefill_charge.take() {
            router::prefill_started(&self.config, host, &mut self.routing.states.borrow_mut(), &charge);
        }
    }

    /// The request is over (completed, reset or refused): estimates go
    /// back, and how it went counts for its workers' health. One that was
    /// still held gives up its place (its client went away).
    pub fn on_done(&mut self, host: &dyn Host) {
        if self.is_held() {
            self.routing.held.remove(self.id);
            self.leave_queue(host, Left::Gone);
        }
        // A prefill still charged (no body came) leaves in the same write as
        // the estimate of its worker.
        let mut charge = self.prefill_charge.take();
        for ticket in [self.ticket.take(), self.prefill_ticket.take()]
            .into_iter()
            .flatten()
        {
            let with = charge.take_if(|c| c.worker == ticket.worker);
            router::release(
                &self.config,
                host,
                &mut self.routing.states.borrow_mut(),
                &ticket,
                with.as_ref(),
            );
        }
        if let Some(charge) = charge {
            router::prefill_started(&self.config, host, &mut self.routing.states.borrow_mut(), &charge);
        }
        if let Some(sent_to) = self.sent_to.take() {
            health_updates::request_ended(&self.config, host, &sent_to);
        }
        // What it held may be room for a held request now.
        let queues = self.config.admission.as_ref().is_some_and(|a| a.queues());
        if queues && self.id != 0 && !self.routing.held.is_empty() {
            self.routing.let_in(host, self.id, false);
        }
    }

    /// Remembers where the request went (`to` first, then its alternates)
    /// and when, if its end can tell something.
    fn remember_sent_to<'c>(
        &mut self,
        to: impl Iterator<Item = &'c Chosen>,
        rank: Option<u32>,
        clean: bool,
        at_ms: u64,
    ) {
        if self.config.passive_health.is_some() || self.config.retry_alternates > 0 {
            self.sent_to = Some(SentTo {
                hosts: addresses(&self.config, to),
                rank,
                routed_at_ms: at_ms,
                health_was_clean: clean,
            });
        }
    }

    /// Remembers a request the cluster's fallback policy sends: its answer
    /// still tells about the host it picks.
    fn remember_fallback(&mut self, host: &dyn Host) {
        if self.config.passive_health.is_some() {
            self.remember_sent_to(std::iter::empty(), None, false, host.now_ms());
        }
    }

    /// Applies a routed decision's headers (the route header; in header
    /// mode the rank headers, which hold for every retry since the
    /// alternates have the same rank, and the class's server priority)
    /// and remembers where it went.
    fn apply_routed(&mut self, host: &dyn Host, routed: &Routed) {
        set_header(
            host,
            &self.config.route_header,
            &route_value(&routed.to, &routed.alternates),
        );
        if let Some(settings) = self.config.header_transport() {
            let mut digits = itoa::Buffer::new();
            if let Some(value) = routed.to.value {
                let value = digits.format(value);
                for name in &settings.rank_headers {
                    set_header(host, name, value);
                }
            }
            let class = self.admitting.map(|a| a.class);
            if let Some(Some(priority)) = router::server_priority(&self.config, class) {
                set_header(host, SERVER_PRIORITY_HEADER, digits.format(priority));
            }
        }
        self.remember_sent_to(
            std::iter::once(&routed.to).chain(&routed.alternates),
            routed.to.rank,
            routed.health_was_clean,
            routed.routed_at_ms,
        );
        self.written = routed.to.rank.zip(routed.to.value).map(|(rank, value)| Written {
            worker: routed.to.worker,
            rank,
            value,
            endpoint: routed.to.endpoint.clone(),
        });
    }

    /// Routes the whole buffered body and applies the decision (or holds
    /// or refuses the request when admission keeps it out).
    fn route_body(&mut self, host: &dyn Host) -> Action {
        self.will_route = false;
        if let Some(action) = self.gate(host) {
            return action;
        }
        match self.decide(host) {
            Decision::Overloaded(overload) => self.overloaded(host, overload),
            decision => {
                self.count_admitted(host);
                self.apply_body(host, decision)
            }
        }
    }

    /// Body mode: the router's decision on the buffered body.
    fn decide_body(&mut self, host: &dyn Host) -> Decision {
        self.config = self.routing.current(host);
        let body = match host.request_body(self.body_size) {
            Ok(body) => body,
            Err(e) => {
                log::warn!("cannot read a request body: {e}; passed on unrouted");
                return router::pass_or_reject(&self.config, host, PassReason::HostRefused, None);
            }
        };
        let args = self.route_args();
        router::route_with(
            &self.config,
            host,
            &mut self.routing.states.borrow_mut(),
            &body,
            &args,
        )
    }

    /// Header mode: the router's decision on what the headers told.
    fn decide_header(&mut self, host: &dyn Host) -> Decision {
        self.config = self.routing.current(host);
        let args = self.route_args();
        router::route_by_headers_with(
            &self.config,
            host,
            &mut self.routing.states.borrow_mut(),
            self.header_cost,
            &args,
        )
    }

    /// What the router needs of this request besides its body.
    fn route_args(&self) -> router::RouteArgs<'_> {
        router::RouteArgs {
            pin: self.pin.as_deref(),
            tie_breaker: self.routing.next_tie_breaker(),
            class: self.admitting.map(|a| a.class),
        }
    }

    /// The router's decision, on the body or on the headers.
    fn decide(&mut self, host: &dyn Host) -> Decision {
        match self.routes_on_body {
            true => self.decide_body(host),
            false => self.decide_header(host),
        }
    }

    /// Applies body mode's decision.
    fn apply_body(&mut self, host: &dyn Host, decision: Decision) -> Action {
        match decision {
            Decision::Route(routed) => {
                self.apply_routed(host, &routed);
                if let Some(new_body) = &routed.body {
                    self.replace_body(host, new_body);
                }
                self.ticket = routed.ticket;
                self.prefill_charge = routed.prefill;
                Action::Continue
            }
            Decision::Pd(pd) => self.start_pd(host, pd),
            Decision::PassThrough { body: new_body, .. } => {
                if let Some(new_body) = &new_body {
                    self.replace_body(host, new_body);
                }
                self.remember_fallback(host);
                Action::Continue
            }
            Decision::Reject { reply, .. } => {
                reply.send(host);
                Action::Pause
            }
            // Only the caller's admission step sees an overload.
            Decision::Overloaded(_) => Action::Pause,
        }
    }

    /// Header mode: routes on what the headers tell and lets the body stream
    /// through untouched.
    fn route_by_headers(&mut self, host: &dyn Host) -> Action {
        if let Some(action) = self.gate(host) {
            return action;
        }
        match self.decide_header(host) {
            Decision::Overloaded(overload) => self.overloaded(host, overload),
            decision => {
                self.count_admitted(host);
                self.apply_header(host, decision)
            }
        }
    }

    /// Applies header mode's decision.
    fn apply_header(&mut self, host: &dyn Host, decision: Decision) -> Action {
        match decision {
            Decision::Route(routed) => {
                self.apply_routed(host, &routed);
                self.ticket = routed.ticket;
                self.prefill_charge = routed.prefill;
                Action::Continue
            }
            Decision::Reject { reply, .. } => {
                reply.send(host);
                Action::Pause
            }
            Decision::PassThrough { .. } => {
                self.remember_fallback(host);
                Action::Continue
            }
            // Header mode never builds a PD decision (validation refuses PD
            // with it); the caller's admission step sees an overload.
            Decision::Pd(_) | Decision::Overloaded(_) => Action::Continue,
        }
    }

    /// Admission: the request's class is admitted (at once or after waiting).
    fn count_admitted(&self, host: &dyn Host) {
        if let (Some(a), Some(settings)) = (self.admitting, &self.config.admission) {
            let class = settings.classes.get(a.class).map_or("", String::as_str);
            host.count(&metrics::admission(AdmissionEvent::Admitted, class), 1);
        }
    }

    /// Admission's look before the router, in queue mode: a request waits
    /// behind held requests of its class or higher (here, or on another
    /// thread at its last look) rather than take the room they wait for; a
    /// sheddable one is refused while anything is held.
    fn gate(&mut self, host: &dyn Host) -> Option<Action> {
        let (Some(settings), Some(a)) = (&self.config.admission, self.admitting) else {
            return None;
        };
        if !settings.queues() {
            return None;
        }
        if settings.is_sheddable(a.class) {
            let refused = self.routing.held.any();
            return refused.then(|| self.refuse(host, RejectReason::Sheddable, 0));
        }
        let waits = self.routing.held.must_wait(a.class);
        waits.then(|| self.hold(host, None))
    }

    /// Every candidate is saturated: a sheddable request, or any in reject
    /// mode, is refused at once (429); in queue mode the request waits.
    fn overloaded(&mut self, host: &dyn Host, overload: Overload) -> Action {
        let (Some(settings), Some(a)) = (self.config.admission.clone(), self.admitting) else {
            return Action::Continue;
        };
        if settings.is_sheddable(a.class) {
            return self.refuse(host, RejectReason::Sheddable, overload.retry_after_ms);
        }
        if !settings.queues() {
            return self.refuse(host, RejectReason::Saturated, overload.retry_after_ms);
        }
        self.hold(host, Some(overload))
    }

    /// Refuses the request (it is on the effective context) with
    /// admission's `reason`, counted by reason and class.
    fn refuse(&mut self, host: &dyn Host, reason: RejectReason, retry_after_ms: u64) -> Action {
        self.count_refusal(host, reason);
        reason.admission_reply(retry_after_ms).send(host);
        Action::Pause
    }

    fn count_refusal(&self, host: &dyn Host, reason: RejectReason) {
        host.count(&metrics::rejected(reason.as_str()), 1);
        if let (Some(a), Some(settings)) = (self.admitting, &self.config.admission) {
            let class = settings.classes.get(a.class).map_or("", String::as_str);
            host.count(&metrics::admission_rejected(reason.as_str(), class), 1);
        }
    }

    /// Queue mode: holds the request for room (paused), or refuses it when
    /// the queue is full; `overload` is what the router saw (None: not
    /// asked, others wait already).
    fn hold(&mut self, host: &dyn Host, overload: Option<Overload>) -> Action {
        let Some(a) = self.admitting else {
            return Action::Continue;
        };
        let retry_after_ms = overload.map_or(0, |o| o.retry_after_ms);
        let now = host.now_ms();
        match self.routing.held.enter(
            &self.config,
            host,
            self.id,
            &self.me,
            a.class,
            a.tenant,
            now,
            retry_after_ms,
        ) {
            Ok(()) => {
                self.admitting = Some(Admitting {
                    held_since: Some(now),
                    holds_place: true,
                    ..a
                });
                if let Some(settings) = &self.config.admission {
                    let class = settings.classes.get(a.class).map_or("", String::as_str);
                    host.count(&metrics::admission(AdmissionEvent::Queued, class), 1);
                }
                Action::Pause
            }
            Err(reason) => self.refuse(host, reason, retry_after_ms),
        }
    }

    /// A held request leaves the queue (already taken out of it), `how`.
    fn leave_queue(&mut self, host: &dyn Host, how: Left) {
        let Some(a) = self.admitting else {
            return;
        };
        let Some(since) = a.held_since else {
            return;
        };
        self.admitting = Some(Admitting {
            held_since: None,
            holds_place: false,
            ..a
        });
        if a.holds_place {
            self.routing.held.released(&self.config, host, a.class);
        }
        host.histogram(
            metrics::ADMISSION_QUEUE_WAIT_MS,
            host.now_ms().saturating_sub(since),
        );
        if let (Left::Gone, Some(settings)) = (how, &self.config.admission) {
            let class = settings.classes.get(a.class).map_or("", String::as_str);
            host.count(&metrics::admission(AdmissionEvent::ClientGone, class), 1);
        }
    }

    /// Its place in the shared record went to a higher class already.
    fn forget_place(&mut self) {
        if let Some(a) = &mut self.admitting {
            a.holds_place = false;
        }
    }

    /// A held request's turn (it is on the effective context, out of the
    /// queue): routed if there is room now.
    pub(crate) fn resume(&mut self, host: &dyn Host) -> Resumed {
        match self.decide(host) {
            Decision::Overloaded(overload) => Resumed::Overloaded(overload),
            decision => {
                self.leave_queue(host, Left::Admitted);
                self.count_admitted(host);
                Resumed::Go(match self.routes_on_body {
                    true => self.apply_body(host, decision),
                    false => self.apply_header(host, decision),
                })
            }
        }
    }

    /// A held request (on the effective context, out of the queue) is
    /// answered by admission with `reason`.
    pub(crate) fn answer_held(&mut self, host: &dyn Host, reason: RejectReason, retry_after_ms: u64) {
        self.leave_queue(host, Left::Refused);
        self.refuse(host, reason, retry_after_ms);
    }

    /// Envoy does not correct `content-length` after a body change: dprank
    /// does. A body the proxy will not replace goes on as the client sent it.
    fn replace_body(&self, host: &dyn Host, body: &[u8]) {
        match host.replace_request_body(self.body_size, body) {
            Ok(()) if self.had_content_length => {
                set_header(host, "content-length", itoa::Buffer::new().format(body.len()));
            }
            Ok(()) => {}
            Err(_) => host.count(&metrics::host_refused(HostCall::ReplaceBody), 1),
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

    /// Sends the prefill leg and forwards the decode leg; a prefill leg Envoy
    /// refuses to dispatch is answered at once.
    fn start_pd(&mut self, host: &dyn Host, pd: PdRouted) -> Action {
        self.ticket = pd.decode_ticket;
        self.prefill_ticket = pd.prefill_ticket;
        self.prefill_charge = pd.prefill_charge;
        if !self.dispatch_prefill(host, &pd) {
            self.on_done(host);
            router::prefill_not_sent(&self.config, host, pd.prefill.worker).send(host);
            return Action::Pause;
        }
        if let Some(decode) = &pd.decode {
            set_header(
                host,
                &self.config.route_header,
                &route_value(decode, &pd.decode_alternates),
            );
        }
        self.replace_body(host, &pd.decode_body);
        let rank = pd.decode.as_ref().and_then(|d| d.rank);
        self.remember_sent_to(
            pd.decode.iter().chain(&pd.decode_alternates),
            rank,
            pd.health_was_clean,
            pd.routed_at_ms,
        );
        Action::Continue
    }

    /// Sends the prefill leg; false if Envoy refused to dispatch it.
    fn dispatch_prefill(&mut self, host: &dyn Host, pd: &PdRouted) -> bool {
        let Some(settings) = self.config.pd() else {
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
                self.prefill_token = Some(token);
                self.prefill = PrefillLeg::Pending {
                    worker: pd.prefill.worker,
                    rank: pd.prefill.rank,
                };
                true
            }
            Err(e) => {
                log::warn!(
                    "prefill call to {endpoint} not dispatched ({e}): is the prefill cluster defined?"
                );
                false
            }
        }
    }
}

/// How a held request left the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Left {
    Admitted,
    Refused,
    /// Its client went away.
    Gone,
}

/// The queue's key for a tenant header value (0 is "no tenant").
fn tenant_key(value: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(value).max(1)
}

/// The hosts chosen workers are sent to (a rank port, where the worker has
/// one per rank): what Envoy's `upstream.address` names.
fn addresses<'a>(config: &Config, chosen: impl Iterator<Item = &'a Chosen>) -> Vec<std::net::SocketAddr> {
    chosen
        .filter_map(|c| {
            let w = config.worker(c.worker)?;
            Some(c.rank.map_or(w.address, |r| w.rank_address(r)))
        })
        .collect()
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

/// Sets a request header; one the proxy refuses is left out and counted
/// (the route header: the cluster's fallback policy picks the host).
fn set_header(host: &dyn Host, name: &str, value: &str) {
    if host.set_request_header(name, value).is_err() {
        host.count(&metrics::host_refused(HostCall::SetHeader), 1);
    }
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
