//! proxy-wasm contexts. They only translate Envoy's callbacks into calls on
//! the router and poller, and apply what those decide.

use crate::config::Config;
use crate::envoy_host::{self as envoy, EnvoyHost};
use crate::poller::{tick_period_ms, Poller};
use crate::router::{self, Decision, PassReason};
use crate::state::Ticket;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use std::cell::Cell;
use std::rc::Rc;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const GIT_REVISION: &str = env!("DPRANK_GIT_REVISION");

#[derive(Default)]
pub struct DprankRoot {
    config: Option<Rc<Config>>,
    poller: Option<Poller>,
    /// Requests seen by this VM: varies the tie-break per request.
    requests: Rc<Cell<u64>>,
}

impl Context for DprankRoot {
    fn on_http_call_response(
        &mut self,
        token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        if let (Some(config), Some(poller)) = (&self.config, &mut self.poller) {
            let status = envoy::call_response_status();
            let body = envoy::call_response_body(body_size);
            poller.on_response(config, &EnvoyHost, token, status, &body);
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
            log::error!("dprank: cannot set the tick period; load polling is off");
        }
        let mut poller = Poller::new(&config);
        // Threads start their tie-break sequences apart, so they don't break ties alike.
        self.requests.set(poller.vm_id(&config, &EnvoyHost).wrapping_mul(0x9E37_79B9));
        self.poller = Some(poller);
        self.config = Some(Rc::new(config));
        true
    }

    fn on_tick(&mut self) {
        if let (Some(config), Some(poller)) = (&self.config, &mut self.poller) {
            poller.on_tick(config, &EnvoyHost);
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        let config = self.config.clone()?;
        Some(Box::new(DprankHttp {
            config,
            requests: self.requests.clone(),
            routing: false,
            had_content_length: false,
            pin: None,
            ticket: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

pub struct DprankHttp {
    config: Rc<Config>,
    requests: Rc<Cell<u64>>,
    /// The body will be read and routed.
    routing: bool,
    had_content_length: bool,
    pin: Option<String>,
    ticket: Option<Ticket>,
}

impl DprankHttp {
    fn replace_body(&self, old_size: usize, body: &[u8]) {
        if envoy::replace_request_body(old_size, body) && self.had_content_length {
            envoy::set_request_header("content-length", Some(&body.len().to_string()));
        }
    }
}

impl Context for DprankHttp {}

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
        if !end_of_stream {
            return Action::Pause;
        }
        self.routing = false;
        let body = envoy::request_body(body_size).unwrap_or_default();
        let tie_breaker = self.requests.get().wrapping_add(1);
        self.requests.set(tie_breaker);
        match router::route(
            &self.config,
            &EnvoyHost,
            &body,
            self.pin.as_deref(),
            tie_breaker,
        ) {
            Decision::Route(routed) => {
                envoy::set_request_header(&self.config.route_header, Some(&routed.endpoint));
                if let Some(new_body) = &routed.body {
                    self.replace_body(body_size, new_body);
                }
                self.ticket = routed.ticket;
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

    fn on_log(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            router::release(&self.config, &EnvoyHost, &ticket);
        }
    }
}
