//! Whole request lifecycles on the fake host, callback by callback as Envoy
//! calls them.

use super::*;
use crate::host::fake::FakeHost;
use crate::router::testing::{fleet, json, pd_fleet};
use crate::store::read_worker_states;

fn request(config: &Config) -> Request {
    Request::new(Rc::new(Routing::new(Rc::new(config.clone()), 0)))
}

fn post(h: &FakeHost, path: &str, body: &[u8], extra: &[(&str, &str)]) {
    let length = body.len().to_string();
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        ("content-length", length.as_str()),
    ];
    headers.extend_from_slice(extra);
    h.start_request(&headers, body);
}

/// Headers, then the whole body in one callback.
fn send(r: &mut Request, h: &FakeHost) -> (Action, Action) {
    let headers = r.on_request_headers(h, false);
    let size = h.request_body.borrow().len();
    (headers, r.on_request_body(h, size, true))
}

fn pending(config: &Config, h: &FakeHost) -> u64 {
    read_worker_states(config, h)
        .iter()
        .flatten()
        .map(|s| s.pending_total())
        .sum()
}

fn reply_status(h: &FakeHost) -> Vec<u32> {
    h.replies.borrow().iter().map(|r| r.0).collect()
}

#[test]
fn a_routed_request_gets_its_endpoint_rank_and_length_and_gives_its_estimate_back() {
    let (c, h) = fleet(r#","pin_header":"x-pin""#);
    let mut r = request(&c);
    let client = [("x-dprank-endpoint", "10.9.9.9:1"), ("x-pin", "zzz/0")];
    post(&h, "/generate?x=1", br#"{"text":"hello there"}"#, &client);
    assert_eq!(send(&mut r, &h), (Action::Pause, Action::Continue));
    assert_eq!(h.header("x-dprank-endpoint").as_deref(), Some("127.0.0.1:2"));
    assert_eq!(h.header("x-pin"), None, "the pin header never reaches the worker");
    let body = h.request_body.borrow().clone();
    assert_eq!(body, br#"{"routed_dp_rank":2,"text":"hello there"}"#);
    assert_eq!(h.header("content-length"), Some(body.len().to_string()));
    assert_eq!(h.counter("dprank.routed.b.rank_2"), 1);
    assert_eq!(h.counter("dprank.pin_ignored"), 1);
    assert!(pending(&c, &h) > 0);
    assert_eq!(
        (r.on_response_headers(&h), r.on_response_body()),
        (Action::Continue, Action::Continue)
    );
    r.on_done(&h);
    assert_eq!(pending(&c, &h), 0);
    assert!(h.replies.borrow().is_empty());
    assert_eq!(h.host_calls("request_body"), 1, "the body is read once");
}

#[test]
fn requests_dprank_does_not_route_pass_untouched_but_lose_the_route_header() {
    let (c, h) = fleet("");
    type Headers<'a> = &'a [(&'a str, &'a str)];
    let cases: [(Headers, bool, &str); 4] = [
        (&[(":method", "GET"), (":path", "/generate")], false, "method"),
        (&[(":method", "POST"), (":path", "/health")], false, "path"),
        (
            &[
                (":method", "POST"),
                (":path", "/generate"),
                ("content-encoding", "gzip"),
            ],
            false,
            "content_encoding",
        ),
        (&[(":method", "POST"), (":path", "/generate")], true, "empty_body"),
    ];
    for (headers, end_of_stream, reason) in cases {
        let mut r = request(&c);
        let mut headers = headers.to_vec();
        headers.push(("x-dprank-endpoint", "127.0.0.1:1"));
        h.start_request(&headers, br#"{"routed_dp_rank":1}"#);
        assert_eq!(
            r.on_request_headers(&h, end_of_stream),
            Action::Continue,
            "{reason}"
        );
        assert_eq!(r.on_request_body(&h, 20, true), Action::Continue);
        assert_eq!(h.header("x-dprank-endpoint"), None);
        assert_eq!(h.request_body.borrow().as_slice(), br#"{"routed_dp_rank":1}"#);
        assert_eq!(h.counter(&format!("dprank.passthrough.{reason}")), 1);
        r.on_done(&h);
    }
    assert_eq!(h.host_calls("request_body"), 0);
}

#[test]
fn a_body_in_chunks_is_routed_once_whole() {
    let (c, h) = fleet("");
    let mut r = request(&c);
    // Chunked: no content-length, so none is added.
    h.start_request(
        &[(":method", "POST"), (":path", "/generate")],
        br#"{"text":"a b c"}"#,
    );
    assert_eq!(r.on_request_headers(&h, false), Action::Pause);
    assert_eq!(r.on_request_body(&h, 5, false), Action::Pause);
    assert_eq!(h.host_calls("request_body"), 0);
    assert_eq!(r.on_request_body(&h, 16, true), Action::Continue);
    assert_eq!(json(&h.request_body.borrow())["routed_dp_rank"], 2);
    assert_eq!(h.header("content-length"), None);
}

#[test]
fn trailers_end_a_body_that_never_saw_end_of_stream() {
    let (c, h) = fleet("");
    let mut r = request(&c);
    post(&h, "/v1/completions", br#"{"prompt":"x"}"#, &[]);
    assert_eq!(r.on_request_headers(&h, false), Action::Pause);
    assert_eq!(r.on_request_body(&h, 14, false), Action::Pause);
    assert_eq!(r.on_request_trailers(&h), Action::Continue);
    assert_eq!(h.header("x-dprank-endpoint").as_deref(), Some("127.0.0.1:2"));
    assert_eq!(r.on_request_trailers(&h), Action::Continue, "routed once");
    assert_eq!(h.counter("dprank.routed.b.rank_2"), 1);
}

#[test]
fn a_refused_body_is_answered_locally() {
    let (c, h) = fleet(r#","fail_mode":"closed""#);
    let mut r = request(&c);
    post(&h, "/generate", b"[1,2]", &[]);
    assert_eq!(send(&mut r, &h), (Action::Pause, Action::Pause));
    assert_eq!(reply_status(&h), vec![400]);
    let (_, headers, body) = h.replies.borrow()[0].clone();
    assert_eq!(
        headers,
        vec![("content-type".to_string(), "application/json".to_string())]
    );
    assert_eq!(json(&body)["error"]["code"], "dprank");
    assert_eq!(h.header("x-dprank-endpoint"), None);
}

#[test]
fn a_reset_stream_gives_its_estimate_back() {
    let (c, h) = fleet("");
    let mut r = request(&c);
    post(&h, "/generate", br#"{"text":"a long prompt"}"#, &[]);
    send(&mut r, &h);
    assert!(pending(&c, &h) > 0);
    r.on_done(&h); // no response ever came
    assert_eq!(pending(&c, &h), 0);
    r.on_done(&h);
    assert_eq!(pending(&c, &h), 0, "released once");
}

/// A PD request through its headers and body: the prefill leg is in flight.
fn pd_request(extra: &str) -> (Rc<Config>, FakeHost, Request) {
    let (c, h) = pd_fleet(extra);
    let mut r = request(&c);
    let client = [
        ("authorization", "Bearer t"),
        ("traceparent", "00-1"),
        ("cookie", "no"),
    ];
    post(&h, "/generate", br#"{"text":"hello","stream":true}"#, &client);
    assert_eq!(send(&mut r, &h), (Action::Pause, Action::Continue));
    (c, h, r)
}

#[test]
fn pd_sends_the_prefill_leg_and_holds_the_decode_response_until_it_is_done() {
    let (c, h, mut r) = pd_request("");
    let calls = h.calls.borrow().clone();
    assert_eq!(calls.len(), 1);
    let (cluster, headers, _) = &calls[0];
    assert_eq!(cluster, "dprank_prefill");
    let header = |name: &str| headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    assert_eq!(header(":path"), Some("/generate"));
    assert_eq!(header("x-envoy-original-dst-host"), Some("10.0.0.1:30000"));
    assert_eq!(
        (header("authorization"), header("traceparent")),
        (Some("Bearer t"), Some("00-1"))
    );
    assert_eq!(header("cookie"), None, "only auth and tracing headers go along");
    let prefill_body = json(h.bodies.borrow()[0].as_ref().unwrap());
    let decode_body = json(&h.request_body.borrow());
    assert_eq!(prefill_body["bootstrap_room"], decode_body["bootstrap_room"]);
    assert_eq!(decode_body["disagg_prefill_dp_rank"], 1);
    assert_eq!(h.header("x-dprank-endpoint").as_deref(), Some("10.0.1.2:30000"));
    assert_eq!(
        h.header("content-length"),
        Some(h.request_body.borrow().len().to_string())
    );

    // The decode response arrives first: held until the prefill is done.
    assert_eq!(r.on_response_headers(&h), Action::Pause);
    assert_eq!(r.on_response_body(), Action::Pause);
    *h.callout.borrow_mut() = (Some(200), b"{}".to_vec());
    r.on_prefill_response(&h, 2);
    assert_eq!(h.resumed.get(), 1);
    assert_eq!(r.on_response_body(), Action::Continue);
    assert_eq!(h.counter("dprank.prefill_ok.p0"), 1);
    assert!(
        pending(&c, &h) > 0,
        "the decode estimate stays while the decode streams"
    );
    r.on_done(&h);
    assert_eq!(pending(&c, &h), 0);
    assert!(h.replies.borrow().is_empty());
}

#[test]
fn a_failed_prefill_answers_the_client_whenever_the_decode_response_comes() {
    // The prefill fails while the decode response is held.
    let (c, h, mut r) = pd_request("");
    assert_eq!(r.on_response_headers(&h), Action::Pause);
    *h.callout.borrow_mut() = (Some(500), b"out of memory".to_vec());
    r.on_prefill_response(&h, 13);
    assert_eq!(reply_status(&h), vec![502]);
    assert!(String::from_utf8_lossy(&h.replies.borrow()[0].2).contains("out of memory"));
    assert_eq!(h.resumed.get(), 0);
    r.on_done(&h);
    assert_eq!(pending(&c, &h), 0);

    // The prefill fails first: the later decode response is replaced too.
    let (_, h, mut r) = pd_request("");
    *h.callout.borrow_mut() = (None, vec![]);
    r.on_prefill_response(&h, 0);
    assert_eq!(r.on_response_headers(&h), Action::Pause);
    assert_eq!(reply_status(&h), vec![502, 502]);
    assert_eq!(h.counter("dprank.prefill_failed.p0"), 1);
}

#[test]
fn a_prefill_leg_envoy_refuses_is_answered_at_once() {
    let (c, h) = pd_fleet("");
    h.refuse_calls.set(true);
    let mut r = request(&c);
    post(&h, "/generate", br#"{"text":"x"}"#, &[]);
    assert_eq!(send(&mut r, &h), (Action::Pause, Action::Pause));
    assert_eq!(reply_status(&h), vec![502]);
    assert_eq!(pending(&c, &h), 0, "both estimates given back");
    assert_eq!(h.counter("dprank.prefill_failed.p0"), 1);
    assert_eq!(r.on_response_headers(&h), Action::Continue);
}

#[test]
fn pd_bodies_that_cannot_carry_bootstrap_fields_are_refused() {
    let (c, h) = pd_fleet("");
    let mut r = request(&c);
    post(&h, "/generate", b"not json", &[]);
    assert_eq!(send(&mut r, &h), (Action::Pause, Action::Pause));
    assert_eq!(reply_status(&h), vec![400]);
    assert!(h.calls.borrow().is_empty());
}

#[test]
fn membership_changes_reach_the_next_request() {
    let c = Config::from_json(br#"{"workers_from_cluster":{"cluster":"sglang"}}"#).unwrap();
    let h = FakeHost::default();
    h.now.set(10_000);
    let routing = Rc::new(Routing::new(Rc::new(c.clone()), 0));
    let members = crate::store::Members(vec!["10.0.0.1:1".parse().unwrap()]);
    crate::store::publish_members(&c, &h, &members).unwrap();
    let current = routing.current(&h);
    crate::router::testing::poll(&current, &h, 0, &[3]);
    let mut r = Request::new(routing);
    post(&h, "/generate", br#"{"text":"x"}"#, &[]);
    send(&mut r, &h);
    assert_eq!(h.header("x-dprank-endpoint").as_deref(), Some("10.0.0.1:1"));
}

/// Rank and bootstrap headers a client might send, in the casing HTTP/1 allows
/// (Envoy hands them over lowercase).
const CLIENT_RANK: [(&str, &str); 6] = [
    ("x-data-parallel-rank", "3"),
    ("x-override-routed-dp-rank", "3"),
    ("x-override-disagg-prefill-dp-rank", "3"),
    ("x-override-bootstrap-host", "10.9.9.9"),
    ("x-override-bootstrap-port", "1"),
    ("x-override-bootstrap-room", "7"),
];

#[test]
fn client_rank_headers_are_removed_from_routed_and_passed_requests_in_body_mode() {
    let (c, h) = fleet("");
    for (path, body, routed) in [
        ("/generate", &br#"{"text":"x"}"#[..], true),
        ("/generate", &b"not json"[..], false),
        ("/health", &br#"{"text":"x"}"#[..], false),
    ] {
        let mut r = request(&c);
        post(&h, path, body, &CLIENT_RANK);
        send(&mut r, &h);
        for (name, _) in CLIENT_RANK {
            assert_eq!(h.header(name), None, "{path} {name}");
        }
        assert_eq!(h.header("x-dprank-endpoint").is_some(), routed, "{path}");
        r.on_done(&h);
    }
}

#[test]
fn header_mode_routes_at_the_headers_and_never_touches_the_body() {
    let (c, h) = fleet(r#","rank_transport":"header","pin_header":"x-pin""#);
    let mut r = request(&c);
    let body = br#"{"model":"m","messages":[{"role":"user","content":"hello"}],"routed_dp_rank":0}"#;
    let mut client = CLIENT_RANK.to_vec();
    client.push(("x-dprank-endpoint", "10.9.9.9:1"));
    post(&h, "/v1/chat/completions", body, &client);
    assert_eq!(
        r.on_request_headers(&h, false),
        Action::Continue,
        "decided at the headers"
    );
    assert_eq!(r.on_request_body(&h, body.len(), true), Action::Continue);
    assert_eq!(h.header("x-dprank-endpoint").as_deref(), Some("127.0.0.1:2"));
    assert_eq!(h.header("x-data-parallel-rank").as_deref(), Some("2"));
    assert_eq!(h.header("x-override-routed-dp-rank").as_deref(), Some("2"));
    for name in [
        "x-override-disagg-prefill-dp-rank",
        "x-override-bootstrap-host",
        "x-override-bootstrap-port",
        "x-override-bootstrap-room",
    ] {
        assert_eq!(h.header(name), None, "{name}");
    }
    assert_eq!(h.request_body.borrow().as_slice(), body, "byte for byte");
    assert_eq!(h.header("content-length"), Some(body.len().to_string()));
    assert_eq!(
        (h.host_calls("request_body"), h.host_calls("replace_request_body")),
        (0, 0)
    );
    assert_eq!(h.counter("dprank.routed.b.rank_2"), 1);
    assert_eq!(
        pending(&c, &h),
        (body.len() as u64).div_ceil(4),
        "content-length / 4"
    );
    r.on_done(&h);
    assert_eq!(pending(&c, &h), 0);
}

#[test]
fn header_mode_counts_a_request_without_length_at_the_configured_default() {
    let (c, h) = fleet(r#","rank_transport":"header","cost_without_length":300,"rank_headers":["x-rank"]"#);
    let mut r = request(&c);
    h.start_request(&[(":method", "POST"), (":path", "/generate")], b"{}");
    assert_eq!(r.on_request_headers(&h, false), Action::Continue);
    assert_eq!(pending(&c, &h), 300);
    assert_eq!(h.header("x-rank").as_deref(), Some("2"));
    assert_eq!(
        h.header("x-data-parallel-rank"),
        None,
        "only the configured headers are set"
    );
    r.on_done(&h);
    // An empty body is not routed, whatever the mode.
    let mut r = request(&c);
    post(&h, "/generate", b"", &[]);
    assert_eq!(r.on_request_headers(&h, false), Action::Continue);
    assert_eq!(h.counter("dprank.passthrough.empty_body"), 1);
    assert_eq!(h.header("x-rank"), None);
}

#[test]
fn header_mode_without_fresh_data_passes_or_refuses_at_the_headers() {
    for (fail_mode, expected) in [("open", Action::Continue), ("closed", Action::Pause)] {
        let c = crate::router::testing::config(&format!(
            r#","rank_transport":"header","fail_mode":"{fail_mode}""#
        ));
        let h = FakeHost::default();
        let mut r = request(&c);
        post(&h, "/generate", br#"{"text":"x"}"#, &CLIENT_RANK);
        assert_eq!(r.on_request_headers(&h, false), expected, "{fail_mode}");
        assert_eq!(
            h.header("x-data-parallel-rank"),
            None,
            "{fail_mode}: the server picks"
        );
        assert_eq!(h.header("x-dprank-endpoint"), None);
        let replies = reply_status(&h);
        assert_eq!(replies, if fail_mode == "open" { vec![] } else { vec![503] });
    }
}

#[test]
fn header_mode_routes_encoded_bodies_it_does_not_need_to_read() {
    let (c, h) = fleet(r#","rank_transport":"header""#);
    let mut r = request(&c);
    post(&h, "/generate", b"\x1f\x8b gzip", &[("content-encoding", "gzip")]);
    assert_eq!(r.on_request_headers(&h, false), Action::Continue);
    assert_eq!(h.header("x-data-parallel-rank").as_deref(), Some("2"));
}

/// Host calls one request costs, callbacks from headers to log. The two
/// routed cases are the second request of a VM on a 2-worker fleet, so both
/// states are in the VM's cache. Before this count was kept (commit 539df31)
/// a body-mode request made 17 calls (4 header reads and a removal, 4
/// shared-data reads) and a passed-through GET 3.
#[test]
fn host_calls_per_request() {
    let count = |extra: &str, headers: &[(&str, &str)], body: &[u8]| {
        let (c, h) = fleet(extra);
        let routing = Rc::new(Routing::new(c.clone(), 0));
        let mut calls = Vec::new();
        for _ in 0..2 {
            let mut r = Request::new(routing.clone());
            h.start_request(headers, body);
            let before = h.total_host_calls();
            send(&mut r, &h);
            let routed = h.header(":method").as_deref() == Some("POST");
            assert_eq!(h.header("x-dprank-endpoint").is_some(), routed, "{extra}");
            r.on_response_headers(&h);
            r.on_response_body();
            r.on_done(&h);
            calls.push(h.total_host_calls() - before);
        }
        calls[1]
    };
    let body = br#"{"text":"hello there"}"#;
    let length = body.len().to_string();
    let post = [
        (":method", "POST"),
        (":path", "/generate"),
        ("content-length", length.as_str()),
    ];
    // Headers read 1; states read 2, estimate written 1 (its cas is the one
    // read), released 2 (read + write); clock 1; counter 1; body read 1 and
    // replaced 1; route header and content-length set 2.
    assert_eq!(count("", &post, body), 12);
    // Header mode: no body calls; route header and two rank headers set.
    assert_eq!(count(r#","rank_transport":"header""#, &post, body), 11);
    assert_eq!(
        count(
            r#","rank_transport":"header","rank_headers":["x-data-parallel-rank"]"#,
            &post,
            body
        ),
        10
    );
    // Passed through: headers read 1, counter 1.
    assert_eq!(count("", &[(":method", "GET"), (":path", "/health")], b""), 2);
}
