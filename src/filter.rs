//! proxy-wasm contexts. They only translate Envoy's callbacks into calls on
//! the router and poller, and apply what those decide.

use crate::config::Config;
use crate::discovery::Membership;
use crate::envoy_host::{self as envoy, EnvoyHost};
use crate::host::Host;
use crate::poller::{tick_period_ms, Poller, POLL_DESTINATION_HEADER};
use crate::router::{self, Decision, PassReason, PdRouted};
use crate::state::Ticket;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use std::cell::{Cell, RefCell};
use std::rc::Rc;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const GIT_REVISION: &str = env!("DPRANK_GIT_REVISION");

#[derive(Default)]
pub struct DprankRoot {
    /// The configuration in force (with the current cluster membership, if any).
    membership: Option<Rc<RefCell<Membership>>>,
    poller: Option<Poller>,
    /// Requests seen by this VM: varies the tie-break per request.
    requests: Rc<Cell<u64>>,
}

impl Context for DprankRoot {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        if let (Some(membership), Some(poller)) = (&self.membership, &mut self.poller) {
            let config = membership.borrow_mut().current(&EnvoyHost);
            let status = envoy::call_response_status();
            let body = envoy::call_response_body(body_size);
            poller.on_response(&config, &EnvoyHost, token, status, &body);
        }
    }
}

impl RootContext for DprankRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = envoy::plugin_configuration().unwrap_or_default();
        let config = match Config::from_json(&bytes) {
            Ok(c) => c,
            Err(e) => {
                log::error!("dprank {VERSION} ({GIT_REVISION}): refusing to start: {e}");
                return false;
            }
        };
        log::info!("dprank {VERSION} ({GIT_REVISION}) starting with {config:?}");
        if config.poll_loads && !envoy::set_tick_period(tick_period_ms(&config)) {
            log::error!("cannot set the tick period; load polling is off");
        }
        let mut poller = Poller::new(EnvoyHost.now_ms());
        // Threads start their tie-break sequences apart, so they don't break ties alike.
        self.requests
            .set(poller.vm_id(&config, &EnvoyHost).wrapping_mul(0x9E37_79B9));
        self.poller = Some(poller);
        self.membership = Some(Rc::new(RefCell::new(Membership::new(Rc::new(config)))));
        true
    }

    fn on_tick(&mut self) {
        if let (Some(membership), Some(poller)) = (&self.membership, &mut self.poller) {
            let config = membership.borrow_mut().current(&EnvoyHost);
            poller.on_tick(&config, &EnvoyHost);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let membership = self.membership.clone()?;
        let config = membership.borrow().base();
        Some(Box::new(DprankHttp {
            config,
            membership,
            requests: self.requests.clone(),
            routing: false,
            body_size: 0,
            had_content_length: false,
            pin: None,
            ticket: None,
            prefill_ticket: None,
            prefill: PrefillLeg::None,
            response_held: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// The prefill leg of a PD request.
enum PrefillLeg {
    /// Regular mode, or not dispatched.
    None,
    Pending {
        worker: usize,
    },
    Done,
    Failed {
        status: u32,
        body: String,
    },
}

pub struct DprankHttp {
    /// The configuration this request is routed (and its estimates released) with.
    config: Rc<Config>,
    membership: Rc<RefCell<Membership>>,
    requests: Rc<Cell<u64>>,
    /// The body will be read and routed.
    routing: bool,
    /// Bytes buffered so far.
    body_size: usize,
    had_content_length: bool,
    pin: Option<String>,
    ticket: Option<Ticket>,
    prefill_ticket: Option<Ticket>,
    prefill: PrefillLeg,
    /// The decode response headers wait for the prefill leg.
    response_held: bool,
}

/// Client headers the prefill leg carries too (auth and tracing).
const PREFILL_FORWARDED_HEADERS: [&str; 4] = ["authorization", "x-request-id", "traceparent", "tracestate"];

impl DprankHttp {
    fn replace_body(&self, old_size: usize, body: &[u8]) {
        if envoy::replace_request_body(old_size, body) && self.had_content_length {
            envoy::set_request_header("content-length", Some(&body.len().to_string()));
        }
    }

    /// Routes the whole buffered body and applies the decision.
    fn route_body(&mut self, body_size: usize) -> Action {
        self.routing = false;
        self.config = self.membership.borrow_mut().current(&EnvoyHost);
        let body = envoy::request_body(body_size).unwrap_or_default();
        let tie_breaker = self.requests.get().wrapping_add(1);
        self.requests.set(tie_breaker);
        match router::route(&self.config, &EnvoyHost, &body, self.pin.as_deref(), tie_breaker) {
            Decision::Route(routed) => {
                envoy::set_request_header(&self.config.route_header, Some(&routed.endpoint));
                if let Some(new_body) = &routed.body {
                    self.replace_body(body_size, new_body);
                }
                self.ticket = routed.ticket;
                Action::Continue
            }
            Decision::Pd(pd) => {
                self.ticket = pd.decode_ticket;
                self.prefill_ticket = pd.prefill_ticket;
                if !self.dispatch_prefill(&pd) {
                    self.release_tickets();
                    let (status, body) =
                        router::prefill_not_sent(&self.config, &EnvoyHost, pd.prefill.worker);
                    envoy::send_response(status, "application/json", body.as_bytes());
                    return Action::Pause;
                }
                if let Some(decode) = &pd.decode {
                    envoy::set_request_header(&self.config.route_header, Some(&decode.endpoint));
                }
                self.replace_body(body_size, &pd.decode_body);
                Action::Continue
            }
            Decision::PassThrough { body: new_body, .. } => {
                if let Some(new_body) = &new_body {
                    self.replace_body(body_size, new_body);
                }
                Action::Continue
            }
            Decision::Reject { status, body } => {
                envoy::send_response(status, "application/json", body.as_bytes());
                Action::Pause
            }
        }
    }

    fn release_tickets(&mut self) {
        for ticket in [self.ticket.take(), self.prefill_ticket.take()]
            .into_iter()
            .flatten()
        {
            router::release(&self.config, &EnvoyHost, &ticket);
        }
    }

    /// Sends the prefill leg; false if Envoy refused to dispatch it.
    fn dispatch_prefill(&mut self, pd: &PdRouted) -> bool {
        let Some(prefill) = &self.config.prefill else {
            return false;
        };
        let path = envoy::request_header(":path").unwrap_or_default();
        let forwarded: Vec<(&str, String)> = PREFILL_FORWARDED_HEADERS
            .iter()
            .filter_map(|h| envoy::request_header(h).map(|v| (*h, v)))
            .collect();
        let mut headers = vec![
            (":method", "POST"),
            (":path", path.as_str()),
            (":authority", pd.prefill.endpoint.as_str()),
            (POLL_DESTINATION_HEADER, pd.prefill.endpoint.as_str()),
            ("content-type", "application/json"),
        ];
        headers.extend(forwarded.iter().map(|(k, v)| (*k, v.as_str())));
        match EnvoyHost.http_call(
            &prefill.cluster,
            &headers,
            Some(&pd.prefill_body),
            prefill.timeout_ms,
        ) {
            Ok(_) => {
                self.prefill = PrefillLeg::Pending {
                    worker: pd.prefill.worker,
                };
                true
            }
            Err(e) => {
                log::warn!("prefill call to {} not dispatched: {e}", pd.prefill.endpoint);
                false
            }
        }
    }
}

impl Context for DprankHttp {
    fn on_http_call_response(&mut self, _token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let PrefillLeg::Pending { worker } = self.prefill else {
            return;
        };
        if let Some(ticket) = self.prefill_ticket.take() {
            router::release(&self.config, &EnvoyHost, &ticket);
        }
        let status = envoy::call_response_status();
        let body = envoy::call_response_body(body_size);
        match router::prefill_outcome(&self.config, &EnvoyHost, worker, status, &body) {
            None => {
                self.prefill = PrefillLeg::Done;
                if self.response_held {
                    self.response_held = false;
                    envoy::resume_response();
                }
            }
            Some((status, body)) => {
                // The decode side waits for a KV cache that will never come: answer now.
                envoy::send_response(status, "application/json", body.as_bytes());
                self.prefill = PrefillLeg::Failed { status, body };
            }
        }
    }
}

impl HttpContext for DprankHttp {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        let config = &self.config;
        // Routing headers are the filter's alone: a client value would steer traffic.
        envoy::set_request_header(&config.route_header, None);
        if let Some(pin_header) = &config.pin_header {
            self.pin = envoy::request_header(pin_header);
            envoy::set_request_header(pin_header, None);
        }
        let reason = if envoy::request_header(":method").as_deref() != Some("POST") {
            Some(PassReason::Method)
        } else if !envoy::request_header(":path").is_some_and(|p| config.routes_path(&p)) {
            Some(PassReason::Path)
        } else if envoy::request_header("content-encoding")
            .is_some_and(|e| !e.eq_ignore_ascii_case("identity"))
        {
            Some(PassReason::Encoded)
        } else if end_of_stream {
            Some(PassReason::EmptyBody)
        } else {
            None
        };
        if let Some(reason) = reason {
            router::pass_early(&EnvoyHost, reason);
            return Action::Continue;
        }
        self.routing = true;
        self.had_content_length = envoy::request_header("content-length").is_some();
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.routing {
            return Action::Continue;
        }
        self.body_size = body_size;
        if !end_of_stream {
            return Action::Pause;
        }
        self.route_body(body_size)
    }

    fn on_http_request_trailers(&mut self, _trailers: usize) -> Action {
        // A body followed by trailers never sees end_of_stream in the body callback.
        if self.routing {
            return self.route_body(self.body_size);
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        match &self.prefill {
            PrefillLeg::Pending { .. } => {
                self.response_held = true;
                Action::Pause
            }
            PrefillLeg::Failed { status, body } => {
                envoy::send_response(*status, "application/json", body.as_bytes());
                Action::Pause
            }
            PrefillLeg::None | PrefillLeg::Done => Action::Continue,
        }
    }

    fn on_http_response_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        // Continuing here would release the held headers with the body.
        if self.response_held {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_log(&mut self) {
        self.release_tickets();
    }
}
