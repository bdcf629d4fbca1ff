//! A proxy-wasm HTTP filter that does nothing but what every body-aware
//! filter must: the floor dprank's overhead is measured against, in the same
//! run, with the same SDK and Envoy settings.
//!
//! The plugin configuration picks the mode:
//! - `pass`: every callback returns at once; the body streams through, as in
//!   dprank's header mode.
//! - `buffer`: the request is held until the whole body has arrived, the body
//!   is read once, then it continues, as dprank's body mode must at least do.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| Box::new(NoopRoot { buffer: false }));
}}

struct NoopRoot {
    buffer: bool,
}

impl Context for NoopRoot {}

impl RootContext for NoopRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        match config.trim_ascii() {
            b"" | b"pass" => self.buffer = false,
            b"buffer" => self.buffer = true,
            _ => return false,
        }
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(if self.buffer {
            Box::new(Buffer)
        } else {
            Box::new(Pass)
        })
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Every callback keeps the SDK's default: continue at once.
struct Pass;

impl Context for Pass {}
impl HttpContext for Pass {}

/// Holds the request until its body is whole, then reads it once.
struct Buffer;

impl Context for Buffer {}

impl HttpContext for Buffer {
    fn on_http_request_headers(&mut self, _headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        std::hint::black_box(body);
        Action::Continue
    }
}
