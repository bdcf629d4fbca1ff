//! A proxy-wasm HTTP filter that does nothing but what every body-aware
//! filter must: the floor dprank's overhead is measured against, in the same
//! run, with the same SDK and Envoy settings.
//!
//! The plugin configuration picks the mode:
//! - `pass`: every callback returns at once; the body streams through, as in
//!   dprank's header mode.
//! - `buffer`: the request is held until the whole body has arrived, the body
//!   is read once, then it continues, as dprank's body mode must at least do.
//! - `route-header <host:port>`: `pass`, plus the header writes of a router
//!   that names a fixed worker and rank 0 (`x-dprank-endpoint`, which
//!   `override_host` reads, and the two rank headers of dprank's header
//!   mode): the mechanics any filter routing by header pays, without a choice.
//! - `route-body <host:port>`: `buffer`, plus the rank field spliced into the
//!   body, the body replaced, and `x-dprank-endpoint` and `content-length`
//!   set, as dprank's body mode writes them: the same for body mode.
//! - `calls <kind>=<n>[,<kind>=<n>...]`: `pass`, plus `n` host calls of each
//!   kind per request and nothing else (`dprank-bench host-calls`): what the
//!   calls dprank makes cost inside Envoy, apart from the code around them.
//!   Kinds are listed in `HostCall`.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, MapType, MetricType};
use std::hint::black_box;
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| Box::new(NoopRoot { mode: Mode::Pass, metric: 0 }));
}}

/// The header `override_host` reads in dprank's shipped Envoy configuration.
const ROUTE_HEADER: &str = "x-dprank-endpoint";
/// The rank headers dprank's header mode sets by default.
const RANK_HEADERS: [&str; 2] = ["x-data-parallel-rank", "x-override-routed-dp-rank"];
/// The headers `calls header-map` adds: as many as dprank's header mode
/// sets, under names no route or upstream reads.
const MAP_HEADERS: [&str; 3] = ["x-noop-route", "x-noop-rank", "x-noop-rank-too"];
/// What `route-body` splices after the body's opening brace.
const RANK_FIELD: &[u8] = b"\"routed_dp_rank\":0";
/// The shared-data key `calls shared-get` reads and `calls shared-set`
/// writes, holding `SHARED_VALUE_BYTES` (about one worker's encoded state).
const SHARED_KEY: &str = "noop.probe";
const SHARED_VALUE_BYTES: usize = 256;

/// One host call dprank makes per request, as `calls` repeats it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HostCall {
    /// `headers`: every request header at once (dprank reads them so).
    Headers,
    /// `set-header`: one request header written.
    SetHeader,
    /// `header-map`: the whole request header map replaced in one call
    /// (`proxy_set_header_map_pairs`) by the request's own headers with
    /// three more (`MAP_HEADERS`), as a router could write its route and
    /// two rank headers at once instead of three `set-header` calls. The
    /// map is read once per request before these calls (a `headers` call,
    /// not counted: a router has read them already).
    HeaderMap,
    /// `shared-get`: a shared-data read of `SHARED_VALUE_BYTES`.
    SharedGet,
    /// `shared-set`: a shared-data write of as many bytes, without cas.
    SharedSet,
    /// `time`: the clock.
    Time,
    /// `metric`: a counter incremented.
    Metric,
    /// `property`: `upstream.request_attempt_count`, read when the request
    /// ends (as dprank reads it).
    Property,
}

impl HostCall {
    fn parse(word: &str) -> Option<HostCall> {
        Some(match word {
            "headers" => HostCall::Headers,
            "set-header" => HostCall::SetHeader,
            "header-map" => HostCall::HeaderMap,
            "shared-get" => HostCall::SharedGet,
            "shared-set" => HostCall::SharedSet,
            "time" => HostCall::Time,
            "metric" => HostCall::Metric,
            "property" => HostCall::Property,
            _ => return None,
        })
    }

    /// Makes the call once; `metric` is the counter `on_configure` defined,
    /// `routed` the header map `header-map` writes.
    fn make(self, metric: u32, routed: &[(String, Vec<u8>)]) {
        match self {
            HostCall::Headers => {
                black_box(hostcalls::get_map(MapType::HttpRequestHeaders).ok());
            }
            HostCall::SetHeader => {
                let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, "x-noop-probe", Some("0"));
            }
            HostCall::HeaderMap => {
                let pairs: Vec<(&str, &[u8])> =
                    routed.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
                let _ = hostcalls::set_map_bytes(MapType::HttpRequestHeaders, pairs);
            }
            HostCall::SharedGet => {
                black_box(hostcalls::get_shared_data(SHARED_KEY).ok());
            }
            HostCall::SharedSet => {
                let value = [b'x'; SHARED_VALUE_BYTES];
                let _ = hostcalls::set_shared_data(SHARED_KEY, Some(&value), None);
            }
            HostCall::Time => {
                black_box(hostcalls::get_current_time().ok());
            }
            HostCall::Metric => {
                let _ = hostcalls::increment_metric(metric, 1);
            }
            HostCall::Property => {
                black_box(hostcalls::get_property(vec!["upstream", "request_attempt_count"]).ok());
            }
        }
    }
}

#[derive(Clone)]
enum Mode {
    Pass,
    Buffer,
    RouteHeader(Rc<str>),
    RouteBody(Rc<str>),
    Calls(Rc<[(HostCall, u32)]>),
}

impl Mode {
    fn parse(config: &str) -> Option<Mode> {
        let mut words = config.split_whitespace();
        let mode = match (words.next(), words.next()) {
            (None | Some("pass"), None) => Mode::Pass,
            (Some("buffer"), None) => Mode::Buffer,
            (Some("route-header"), Some(endpoint)) => Mode::RouteHeader(endpoint.into()),
            (Some("route-body"), Some(endpoint)) => Mode::RouteBody(endpoint.into()),
            (Some("calls"), Some(list)) => Mode::Calls(parse_calls(list)?),
            _ => return None,
        };
        words.next().is_none().then_some(mode)
    }
}

/// `kind=n,kind=n`: each kind at most once, n at least 1.
fn parse_calls(list: &str) -> Option<Rc<[(HostCall, u32)]>> {
    let mut calls: Vec<(HostCall, u32)> = Vec::new();
    for item in list.split(',') {
        let (kind, n) = item.split_once('=')?;
        let (kind, n) = (HostCall::parse(kind)?, n.parse().ok().filter(|n| *n > 0)?);
        if calls.iter().any(|(k, _)| *k == kind) {
            return None;
        }
        calls.push((kind, n));
    }
    Some(calls.into())
}

struct NoopRoot {
    mode: Mode,
    /// The counter `calls metric` increments.
    metric: u32,
}

impl Context for NoopRoot {}

impl RootContext for NoopRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        match std::str::from_utf8(&config).ok().and_then(Mode::parse) {
            Some(mode) => {
                if let Mode::Calls(calls) = &mode {
                    for (kind, _) in calls.iter() {
                        let prepared = match kind {
                            HostCall::Metric => hostcalls::define_metric(MetricType::Counter, "noop.probe")
                                .map(|id| self.metric = id)
                                .is_ok(),
                            HostCall::SharedGet => hostcalls::set_shared_data(
                                SHARED_KEY,
                                Some(&[b'x'; SHARED_VALUE_BYTES]),
                                None,
                            )
                            .is_ok(),
                            _ => true,
                        };
                        if !prepared {
                            return false;
                        }
                    }
                }
                self.mode = mode;
                true
            }
            None => false,
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(match &self.mode {
            Mode::Pass => Box::new(Pass),
            Mode::Buffer => Box::new(Buffer { route: None }),
            Mode::RouteHeader(endpoint) => Box::new(RouteHeader(endpoint.clone())),
            Mode::RouteBody(endpoint) => Box::new(Buffer {
                route: Some(endpoint.clone()),
            }),
            Mode::Calls(calls) => Box::new(Calls {
                calls: calls.clone(),
                metric: self.metric,
            }),
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

/// Names the worker and rank 0 in headers, then continues at once.
struct RouteHeader(Rc<str>);

impl Context for RouteHeader {}

impl HttpContext for RouteHeader {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.set_http_request_header(ROUTE_HEADER, Some(self.0.as_ref()));
        for name in RANK_HEADERS {
            self.set_http_request_header(name, Some("0"));
        }
        Action::Continue
    }
}

/// Makes its calls: `property` when the request ends (when dprank reads
/// it), the others on the request's headers.
struct Calls {
    calls: Rc<[(HostCall, u32)]>,
    metric: u32,
}

impl Calls {
    fn make(&self, at_end: bool) {
        let routed = if !at_end && self.calls.iter().any(|(k, _)| *k == HostCall::HeaderMap) {
            routed_headers()
        } else {
            Vec::new()
        };
        for &(kind, n) in self.calls.iter() {
            if (kind == HostCall::Property) == at_end {
                for _ in 0..n {
                    kind.make(self.metric, &routed);
                }
            }
        }
    }
}

/// The request's headers, in the order Envoy gave them, with `MAP_HEADERS` set.
fn routed_headers() -> Vec<(String, Vec<u8>)> {
    let mut pairs: Vec<(String, Vec<u8>)> = hostcalls::get_map_bytes(MapType::HttpRequestHeaders)
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| !MAP_HEADERS.contains(&k.as_str()))
        .collect();
    for name in MAP_HEADERS {
        pairs.push((name.to_string(), b"0".to_vec()));
    }
    pairs
}

impl Context for Calls {}

impl HttpContext for Calls {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.make(false);
        Action::Continue
    }

    fn on_log(&mut self) {
        self.make(true);
    }
}

/// Holds the request until its body is whole, then reads it once; with a
/// route, also rewrites it with the rank field and names the worker.
struct Buffer {
    route: Option<Rc<str>>,
}

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
        let Some(endpoint) = &self.route else {
            std::hint::black_box(body);
            return Action::Continue;
        };
        let rewritten = with_rank_field(&body);
        self.set_http_request_body(0, body_size, &rewritten);
        self.set_http_request_header(ROUTE_HEADER, Some(endpoint.as_ref()));
        self.set_http_request_header("content-length", Some(&rewritten.len().to_string()));
        Action::Continue
    }
}

/// The body with the rank field first in its top-level object (unchanged
/// if it is not an object).
fn with_rank_field(body: &[u8]) -> Vec<u8> {
    let Some(open) = body.iter().position(|b| !b.is_ascii_whitespace()) else {
        return body.to_vec();
    };
    if body.get(open) != Some(&b'{') {
        return body.to_vec();
    }
    let (head, rest) = body.split_at(open + 1);
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = Vec::with_capacity(body.len() + RANK_FIELD.len() + 1);
    out.extend_from_slice(head);
    out.extend_from_slice(RANK_FIELD);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_bad_ones_are_refused() {
        assert!(matches!(Mode::parse(""), Some(Mode::Pass)));
        assert!(matches!(Mode::parse(" buffer\n"), Some(Mode::Buffer)));
        assert!(
            matches!(Mode::parse("route-header 127.0.0.1:1"), Some(Mode::RouteHeader(e)) if &*e == "127.0.0.1:1")
        );
        assert!(matches!(
            Mode::parse("route-body 127.0.0.1:1"),
            Some(Mode::RouteBody(_))
        ));
        assert!(Mode::parse("route-header").is_none());
        assert!(Mode::parse("pass extra").is_none());
        assert!(Mode::parse("route-body a b").is_none());
        assert!(
            matches!(Mode::parse("calls shared-get=40"), Some(Mode::Calls(c)) if *c == [(HostCall::SharedGet, 40)])
        );
        assert!(
            matches!(Mode::parse("calls header-map=1"), Some(Mode::Calls(c)) if *c == [(HostCall::HeaderMap, 1)])
        );
        assert!(matches!(
            Mode::parse("calls headers=1,property=2"),
            Some(Mode::Calls(c)) if *c == [(HostCall::Headers, 1), (HostCall::Property, 2)]
        ));
        for bad in [
            "calls",
            "calls shared-get",
            "calls nothing=4",
            "calls time=-1",
            "calls time=0",
            "calls time=1,time=2",
            "calls time=4 5",
        ] {
            assert!(Mode::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn the_rank_field_is_spliced_first() {
        assert_eq!(
            with_rank_field(br#"{"text":"x"}"#),
            br#"{"routed_dp_rank":0,"text":"x"}"#
        );
        assert_eq!(with_rank_field(b" { } "), br#" {"routed_dp_rank":0 } "#);
        assert_eq!(with_rank_field(b"[1]"), b"[1]");
        assert_eq!(with_rank_field(b""), b"");
    }
}
