//! proxy-wasm contexts. They only translate Envoy's callbacks into calls on
//! the poller and admission's passes (root context) and the request
//! lifecycle (HTTP context).

use crate::config::Config;
use crate::envoy_host::EnvoyHost;
use crate::host::Host;
use crate::poller::Poller;
use crate::request::{self, queue_tick_period_ms, Request, Routing};
use crate::shared_data;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use std::cell::RefCell;
use std::rc::Rc;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const GIT_REVISION: &str = env!("DPRANK_GIT_REVISION");

pub struct DprankRoot {
    /// Envoy's id of this root context.
    id: u32,
    routing: Option<Rc<Routing>>,
    poller: Option<Poller>,
}

impl DprankRoot {
    pub fn new(id: u32) -> DprankRoot {
        DprankRoot {
            id,
            routing: None,
            poller: None,
        }
    }
}

fn action(a: request::Action) -> Action {
    match a {
        request::Action::Continue => Action::Continue,
        request::Action::Pause => Action::Pause,
    }
}

impl Context for DprankRoot {
    fn on_http_call_response(&mut self, token: u32, headers: usize, body_size: usize, _trailers: usize) {
        if let (Some(routing), Some(poller)) = (&self.routing, &mut self.poller) {
            if request::on_root_callout(routing, &EnvoyHost, token, headers, body_size, self.id) {
                return;
            }
            let config = routing.current(&EnvoyHost);
            let answer = EnvoyHost.callout_response(headers, body_size);
            poller.on_response(&config, &EnvoyHost, token, &answer);
            // A poll may show room for held requests.
            request::let_in(routing, &EnvoyHost, self.id, true);
        }
    }

    /// The plugin is going away (a new configuration, or Envoy stopping):
    /// every held request is answered.
    fn on_done(&mut self) -> bool {
        if let Some(routing) = &self.routing {
            request::drain_held(routing, &EnvoyHost, self.id);
        }
        true
    }
}

impl RootContext for DprankRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = match EnvoyHost::plugin_configuration() {
            Ok(bytes) => bytes,
            Err(e) => {
                log::error!("dprank {VERSION} ({GIT_REVISION}): refusing to start: cannot read the configuration: {e}");
                return false;
            }
        };
        let config = match Config::from_json(&bytes) {
            Ok(c) => c,
            Err(e) => {
                log::error!("dprank {VERSION} ({GIT_REVISION}): refusing to start: {e}");
                return false;
            }
        };
        let json = config.to_json();
        if shared_data::first_to_announce(&config, &EnvoyHost, &json) {
            log::info!("dprank {VERSION} ({GIT_REVISION}) starting with {json}");
        }
        let ticks = config.poll_loads || config.admission.is_some();
        if let (true, Err(e)) = (ticks, EnvoyHost::set_tick_period(queue_tick_period_ms(&config))) {
            log::error!("cannot set the tick period ({e}); load polling and admission's queue are off");
        }
        let mut poller = Poller::new(EnvoyHost.now_ms());
        // Threads start their tie-break sequences apart, so they don't break
        // ties alike; the random part sets other Envoys apart too, whose VM
        // counters start at 1 like ours (the headroom picker's draws would
        // otherwise be the same on every gateway).
        let vm = poller.vm_id(&config, &EnvoyHost);
        let seed = vm.wrapping_mul(0x9E37_79B9) ^ EnvoyHost.random_u64();
        self.poller = Some(poller);
        let routing = Routing::new(Rc::new(config), seed);
        routing.set_vm(vm);
        self.routing = Some(Rc::new(routing));
        true
    }

    fn on_tick(&mut self) {
        if let (Some(routing), Some(poller)) = (&self.routing, &mut self.poller) {
            let config = routing.current(&EnvoyHost);
            if config.poll_loads {
                poller.on_tick(&config, &EnvoyHost);
            }
            request::on_admission_tick(routing, &EnvoyHost, self.id);
        }
    }

    /// Never None: the SDK panics on None. Without a configuration (one
    /// that was refused) requests pass through untouched.
    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        match self.routing.clone() {
            Some(routing) => Some(Box::new(DprankHttp(Request::shared(routing, context_id)))),
            None => Some(Box::new(Unconfigured)),
        }
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// A request's context: the lifecycle, shared with admission's queue on
/// this thread while it is held (the root's passes then act on it; Envoy
/// runs one callback at a time per thread, so it is never borrowed twice).
pub struct DprankHttp(Rc<RefCell<Request>>);

impl Context for DprankHttp {
    fn on_http_call_response(&mut self, _token: u32, headers: usize, body_size: usize, _trailers: usize) {
        self.0
            .borrow_mut()
            .on_prefill_response(&EnvoyHost, headers, body_size);
    }
}

/// A request on a filter without a configuration: it goes on untouched
/// (every callback's default is Continue).
struct Unconfigured;

impl Context for Unconfigured {}
impl HttpContext for Unconfigured {}

impl HttpContext for DprankHttp {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        action(self.0.borrow_mut().on_request_headers(&EnvoyHost, end_of_stream))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(
            self.0
                .borrow_mut()
                .on_request_body(&EnvoyHost, body_size, end_of_stream),
        )
    }

    fn on_http_request_trailers(&mut self, _trailers: usize) -> Action {
        action(self.0.borrow_mut().on_request_trailers(&EnvoyHost))
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        action(self.0.borrow_mut().on_response_headers(&EnvoyHost))
    }

    fn on_http_response_body(&mut self, body_size: usize, _end_of_stream: bool) -> Action {
        action(self.0.borrow_mut().on_response_body(&EnvoyHost, body_size))
    }

    fn on_log(&mut self) {
        self.0.borrow_mut().on_done(&EnvoyHost);
    }
}
