//! Whole request lifecycles on the fake host, callback by callback as Envoy
//! calls them.

use super::*;
use crate::config::QueueMeasure;
use crate::host::fake::FakeHost;
use crate::host::HostError;
use crate::shared_data::testing::{fleet, json, pd_fleet, poll};
use crate::shared_data::{self, read_worker_states};

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
    // b, then a (which has rank 2 too) for Envoy's retries.
    assert_eq!(
        h.header("x-dprank-endpoint").as_deref(),
        Some("127.0.0.1:2,127.0.0.1:1")
    );
    assert_eq!(h.header("x-pin"), None, "the pin header never reaches the worker");
    let body = h.request_body.borrow().clone();
    assert_eq!(body, br#"{"routed_dp_rank":2,"text":"hello there"}"#);
    assert_eq!(h.header("content-length"), Some(body.len().to_string()));
    assert_eq!(h.counter("dprank.routed.b.rank_2"), 1);
    assert_eq!(h.counter("dprank.pin_ignored"), 1);
    assert!(pending(&c, &h) > 0);
    assert_eq!(
        (r.on_response_headers(&h), r.on_response_body(&h, 0)),
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
    assert_eq!(
        h.header("x-dprank-endpoint").as_deref(),
        Some("127.0.0.1:2,127.0.0.1:1")
    );
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
    assert_eq!(
        h.header("x-dprank-endpoint").as_deref(),
        Some("10.0.1.2:30000,10.0.1.1:30000"),
        "the other decode worker for retries"
    );
    assert_eq!(
        h.header("content-length"),
        Some(h.request_body.borrow().len().to_string())
    );

    // The decode response arrives first: held until the prefill is done.
    assert_eq!(r.on_response_headers(&h), Action::Pause);
    assert_eq!(r.on_response_body(&h, 0), Action::Pause);
    *h.callout.borrow_mut() = (Some(200), b"{}".to_vec());
    r.on_prefill_response(&h, 1, 2);
    assert_eq!(h.resumed.get(), 1);
    assert_eq!(r.on_response_body(&h, 0), Action::Continue);
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
    r.on_prefill_response(&h, 1, 13);
    assert_eq!(reply_status(&h), vec![502]);
    assert!(String::from_utf8_lossy(&h.replies.borrow()[0].2).contains("out of memory"));
    assert_eq!(h.resumed.get(), 0);
    r.on_done(&h);
    assert_eq!(pending(&c, &h), 0);

    // The prefill fails first: the later decode response is replaced too.
    let (_, h, mut r) = pd_request("");
    *h.callout.borrow_mut() = (None, vec![]);
    r.on_prefill_response(&h, 1, 0);
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
    let members = crate::shared_data::Members(vec!["10.0.0.1:1".parse().unwrap()]);
    crate::shared_data::publish_members(&c, &h, &members).unwrap();
    let current = routing.current(&h);
    crate::shared_data::testing::poll(&current, &h, 0, &[3]);
    let mut r = Request::new(routing);
    post(&h, "/generate", br#"{"text":"x"}"#, &[]);
    send(&mut r, &h);
    assert_eq!(h.header("x-dprank-endpoint").as_deref(), Some("10.0.0.1:1"));
}

/// Sends one routed request that ends as Envoy reports; returns the route header.
fn routed_and_ended(
    c: &Config,
    h: &FakeHost,
    code: u64,
    details: &str,
    upstream: &str,
    attempts: u64,
) -> String {
    let mut r = request(c);
    post(h, "/generate", br#"{"text":"x"}"#, &[]);
    send(&mut r, h);
    let route = h.header("x-dprank-endpoint").unwrap_or_default();
    h.finish_request(code, details, Some(upstream), attempts);
    r.on_done(h);
    route
}

#[test]
fn a_worker_answering_500_leaves_rotation_after_five_and_comes_back_after_a_probe() {
    let (c, h) = fleet(r#","passive_health":{"probe_share":1.0}"#);
    for i in 1..=5 {
        let route = routed_and_ended(&c, &h, 500, "via_upstream", "127.0.0.1:2", 1);
        assert!(route.starts_with("127.0.0.1:2"), "{i}: b is the least loaded");
        assert_eq!(h.counter("dprank.failures.b"), i);
    }
    assert_eq!(h.counter("dprank.ejections.b"), 1);
    assert_eq!(h.gauge_value("dprank.health.b"), Some(2));
    // b's rank 2 was ejected along with it (every failure was on rank 2).
    assert_eq!(h.counter("dprank.rank_ejections.b"), 1);
    let route = routed_and_ended(&c, &h, 200, "via_upstream", "127.0.0.1:1", 1);
    assert_eq!(route, "127.0.0.1:1", "a alone: b is out, so no alternate either");
    assert_eq!(h.counter("dprank.retry.no_alternate"), 1);
    // After the cooldown (10 s), every request may probe (share 1.0 here).
    h.now.set(h.now.get() + 10_000);
    // Keep the loads fresh.
    crate::shared_data::testing::poll(&c, &h, 0, &[100, 50, 100, 100]);
    crate::shared_data::testing::poll(&c, &h, 1, &[100, 100, 20, 100]);
    let route = routed_and_ended(&c, &h, 200, "via_upstream", "127.0.0.1:2", 1);
    assert!(route.starts_with("127.0.0.1:2"), "the probe: {route}");
    let route = routed_and_ended(&c, &h, 200, "via_upstream", "127.0.0.1:2", 1);
    assert_eq!(route, "127.0.0.1:2,127.0.0.1:1", "back in rotation");
    assert_eq!(h.counter("dprank.failures.b"), 5);
}

#[test]
fn successes_on_a_healthy_fleet_write_nothing_and_client_errors_never_count() {
    let (c, h) = fleet("");
    routed_and_ended(&c, &h, 200, "via_upstream", "127.0.0.1:2", 1);
    let (gets, sets) = (h.host_calls("shared_get"), h.host_calls("shared_set"));
    let properties = h.host_calls("property");
    routed_and_ended(&c, &h, 200, "via_upstream", "127.0.0.1:2", 1);
    assert_eq!(
        h.host_calls("property") - properties,
        2,
        "attempts and status: not the code details, not the upstream"
    );
    // Routing reads the states and the health record, and writes the estimate
    // (under the cas it read) and its release (after a read: this VM wrote
    // last); the end reads nothing more.
    assert_eq!(h.host_calls("shared_get") - gets, 2 + 1 + 1);
    assert_eq!(h.host_calls("shared_set") - sets, 2);
    for _ in 0..20 {
        routed_and_ended(&c, &h, 400, "via_upstream", "127.0.0.1:2", 1);
    }
    assert_eq!(h.counter("dprank.failures.b"), 0);
    assert!(shared_data::read_health(&c, &h).entries.is_empty());
}

#[test]
fn a_refused_connection_counts_for_the_chosen_worker_and_the_retry_for_the_alternate() {
    let (c, h) = fleet("");
    let refused = "upstream_reset_before_response_started{connection_failure}";
    // The chosen worker (b) refused; Envoy retried on the alternate (a), which answered.
    let route = routed_and_ended(&c, &h, 200, "via_upstream", "127.0.0.1:1", 2);
    assert_eq!(route, "127.0.0.1:2,127.0.0.1:1");
    assert_eq!(h.counter("dprank.retry.to_alternate"), 1);
    assert_eq!(h.counter("dprank.failures.b"), 1);
    assert_eq!(h.counter("dprank.failures.a"), 0);
    // Both refused; the fallback policy found nothing better.
    routed_and_ended(&c, &h, 503, refused, "127.0.0.1:1", 3);
    assert_eq!(h.counter("dprank.failures.a"), 1);
    assert_eq!(h.counter("dprank.failures.b"), 2);
    let health = shared_data::read_health(&c, &h);
    let b: std::net::SocketAddr = "127.0.0.1:2".parse().unwrap();
    let b_entry = health
        .entries
        .iter()
        .find(|e| e.target.worker == b && e.target.rank.is_none());
    assert_eq!(b_entry.map(|e| e.failures), Some(2), "{health:?}");
    assert!(
        health.entries.iter().all(|e| e.target.rank.is_none()),
        "no rank saw these requests"
    );
    // Served by a host outside the list (the fallback policy's pick).
    routed_and_ended(&c, &h, 400, "via_upstream", "127.0.0.1:9", 3);
    assert_eq!(h.counter("dprank.retry.to_fallback"), 1);
}

#[test]
fn passive_health_off_reads_no_properties_but_retries_are_still_counted() {
    let (c, h) = fleet(r#","passive_health":{"enabled":false},"retry_alternates":0"#);
    let route = routed_and_ended(&c, &h, 500, "via_upstream", "127.0.0.1:2", 1);
    assert_eq!(route, "127.0.0.1:2", "no alternates");
    assert_eq!(h.host_calls("property"), 0);
    assert_eq!(h.counter("dprank.failures.b"), 0);
    let (c, h) = fleet(r#","passive_health":{"enabled":false}"#);
    routed_and_ended(&c, &h, 200, "via_upstream", "127.0.0.1:1", 2);
    assert_eq!(h.counter("dprank.retry.to_alternate"), 1);
    assert!(shared_data::read_health(&c, &h).entries.is_empty());
}

#[test]
fn with_every_worker_out_of_rotation_requests_pass_through_until_a_poll_reaches_one() {
    for closed in [false, true] {
        let (c, h) = fleet(if closed { r#","fail_mode":"closed""# } else { "" });
        let refused = "upstream_reset_before_response_started{connection_failure}";
        // Both refuse: b first, then its alternate a, then the fallback's pick.
        for _ in 0..5 {
            routed_and_ended(&c, &h, 503, refused, "127.0.0.1:1", 3);
        }
        assert_eq!(
            h.counter("dprank.ejections.a") + h.counter("dprank.ejections.b"),
            2
        );
        let route = routed_and_ended(&c, &h, 503, "no_healthy_upstream", "127.0.0.1:1", 1);
        assert_eq!(route, "", "no route header: the fallback policy picks");
        if closed {
            assert_eq!(reply_status(&h), vec![503]);
            assert_eq!(h.counter("dprank.rejected.none_in_rotation"), 1);
        } else {
            assert_eq!(h.counter("dprank.passthrough.none_in_rotation"), 1);
        }
        assert_eq!(
            h.counter("dprank.passthrough.no_fresh_data"),
            0,
            "the data is fresh"
        );
        // b answers its load poll: probed at once, and (nothing else being in
        // rotation) by every request until it answers one.
        crate::health_updates::poll_answered(&c, &h, "127.0.0.1:2".parse().unwrap());
        let route = routed_and_ended(&c, &h, 200, "via_upstream", "127.0.0.1:2", 1);
        assert_eq!(route, "127.0.0.1:2", "a is still out: no alternate");
        let route = routed_and_ended(&c, &h, 200, "via_upstream", "127.0.0.1:2", 1);
        assert_eq!(route, "127.0.0.1:2", "b is back");
        assert_eq!(h.gauge_value("dprank.health.b"), Some(0));
    }
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
    // b, then a (which has rank 2 too) for Envoy's retries: the rank headers
    // hold for whichever serves it.
    assert_eq!(
        h.header("x-dprank-endpoint").as_deref(),
        Some("127.0.0.1:2,127.0.0.1:1")
    );
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
        let c = crate::shared_data::testing::config(&format!(
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
fn about_the_probe_share_of_requests_go_to_a_worker_past_its_cooldown() {
    let (c, h) = fleet("");
    for _ in 0..5 {
        routed_and_ended(&c, &h, 500, "via_upstream", "127.0.0.1:2", 1);
    }
    h.now.set(h.now.get() + 10_000);
    crate::shared_data::testing::poll(&c, &h, 0, &[100, 50, 100, 100]);
    crate::shared_data::testing::poll(&c, &h, 1, &[100, 100, 20, 100]);
    // b is probing and the least loaded; 429 answers leave it probing. One
    // VM's requests share its tie-break sequence, which draws the probes.
    let routing = Rc::new(Routing::new(c.clone(), 7));
    let to_b = (0..2000)
        .filter(|_| {
            let mut r = Request::new(routing.clone());
            post(&h, "/generate", br#"{"text":"x"}"#, &[]);
            send(&mut r, &h);
            let route = h.header("x-dprank-endpoint").unwrap_or_default();
            h.finish_request(429, "via_upstream", Some("127.0.0.1:2"), 1);
            r.on_done(&h);
            route.starts_with("127.0.0.1:2")
        })
        .count();
    assert!((60..=140).contains(&to_b), "{to_b} of 2000 at a 5% probe share");
}

#[test]
fn header_mode_routes_encoded_bodies_it_does_not_need_to_read() {
    let (c, h) = fleet(r#","rank_transport":"header""#);
    let mut r = request(&c);
    post(&h, "/generate", b"\x1f\x8b gzip", &[("content-encoding", "gzip")]);
    assert_eq!(r.on_request_headers(&h, false), Action::Continue);
    assert_eq!(h.header("x-data-parallel-rank").as_deref(), Some("2"));
}

#[test]
fn a_request_a_poll_has_counted_gives_nothing_back() {
    let (c, h) = fleet(r#","prefix_affinity":false"#);
    let routing = Rc::new(Routing::new(c.clone(), 0));
    let routed = |body: &[u8]| {
        let mut r = Request::new(routing.clone());
        post(&h, "/generate", body, &[]);
        send(&mut r, &h);
        r
    };
    let mut first = routed(br#"{"text":"hello there"}"#);
    assert!(pending(&c, &h) > 0);
    // Polls that left after it count it, and drop its estimate.
    crate::shared_data::testing::poll(&c, &h, 0, &[100, 50, 100, 100]);
    crate::shared_data::testing::poll(&c, &h, 1, &[100, 100, 25, 100]);
    assert_eq!(pending(&c, &h), 0);
    // A request routed since brings the new snapshots into this VM's copy.
    let _second = routed(br#"{"text":"hi"}"#);
    let second_estimate = pending(&c, &h);
    assert!(second_estimate > 0);
    h.finish_request(200, "via_upstream", Some("127.0.0.1:2"), 1);
    let (gets, sets) = (h.host_calls("shared_get"), h.host_calls("shared_set"));
    first.on_done(&h);
    assert_eq!(
        (
            h.host_calls("shared_get") - gets,
            h.host_calls("shared_set") - sets
        ),
        (0, 0),
        "nothing to give back: no shared-data call"
    );
    assert_eq!(pending(&c, &h), second_estimate, "the other estimate stays");
    // Counted by a poll this VM has not seen yet: the end reads the state,
    // finds nothing to give back, and writes nothing.
    let mut third = routed(br#"{"text":"third"}"#);
    crate::shared_data::testing::poll(&c, &h, 0, &[100, 50, 100, 100]);
    crate::shared_data::testing::poll(&c, &h, 1, &[100, 100, 30, 100]);
    assert_eq!(pending(&c, &h), 0);
    let sets = h.host_calls("shared_set");
    third.on_done(&h);
    assert_eq!(h.host_calls("shared_set") - sets, 0);
    assert_eq!(pending(&c, &h), 0);
}

/// Host calls one request costs, callbacks from headers to log, where
/// Envoy answered with the chosen worker's 200. The routed cases are the
/// second request of a VM on a 2-worker fleet, so both states are in the
/// VM's cache. Before this count was kept (commit 539df31) a body-mode
/// request made 17 calls (4 header reads and a removal, 4 shared-data reads)
/// and a passed-through GET 3; passive health and retry alternates (issue
/// 14) add 3: the health record's read and two properties at the end.
/// Host calls of one whole request (the second of two, so that the VM's
/// tables and cache are warm).
fn calls_per_request(c: &Rc<Config>, h: &FakeHost, headers: &[(&str, &str)], body: &[u8]) -> u64 {
    let routing = Rc::new(Routing::new(c.clone(), 0));
    let mut calls = Vec::new();
    for _ in 0..2 {
        let mut r = Request::new(routing.clone());
        h.start_request(headers, body);
        let before = h.total_host_calls();
        send(&mut r, h);
        let routed = h.header(":method").as_deref() == Some("POST");
        let route = h.header("x-dprank-endpoint");
        assert_eq!(route.is_some(), routed);
        r.on_response_headers(h);
        r.on_response_body(h, 0);
        let upstream = route.as_deref().and_then(|r| r.split(',').next());
        h.finish_request(200, "via_upstream", upstream, 1);
        r.on_done(h);
        calls.push(h.total_host_calls() - before);
    }
    calls[1]
}

#[test]
fn host_calls_per_request() {
    let count = |extra: &str, headers: &[(&str, &str)], body: &[u8]| {
        let (c, h) = fleet(extra);
        calls_per_request(&c, &h, headers, body)
    };
    let body = br#"{"text":"hello there"}"#;
    let length = body.len().to_string();
    let post = [
        (":method", "POST"),
        (":path", "/generate"),
        ("content-length", length.as_str()),
    ];
    // Headers read 1; states read 2 and the health record 1, estimate
    // written 1 (its cas is the one read), released 2 (read + write); clock
    // 1; counter 1; body read 1 and replaced 1; route header (with its
    // alternate) and content-length set 2; the response's status 1 (a 400
    // could refuse the rank value); at the end, the attempts and the status 2.
    let load_only = r#","prefix_affinity":false"#;
    assert_eq!(count(load_only, &post, body), 16);
    // Prefix affinity (the default) adds 2 here: a prefix-index read and
    // the chosen worker's index written (its ages use the clock read above).
    assert_eq!(count("", &post, body), 18);
    // Without passive health or alternates: no health record, no properties.
    let plain = r#","prefix_affinity":false,"passive_health":{"enabled":false},"retry_alternates":0"#;
    assert_eq!(count(plain, &post, body), 13);
    // Alternates alone: the attempts, to count retries.
    let alternates = r#","prefix_affinity":false,"passive_health":{"enabled":false}"#;
    assert_eq!(count(alternates, &post, body), 14);
    // Header mode: no body calls; route header and two rank headers set.
    assert_eq!(count(r#","rank_transport":"header""#, &post, body), 15);
    assert_eq!(
        count(
            r#","rank_transport":"header","rank_headers":["x-data-parallel-rank"]"#,
            &post,
            body
        ),
        14
    );
    // Passed through: headers read 1, counter 1.
    assert_eq!(count("", &[(":method", "GET"), (":path", "/health")], b""), 2);
}

#[test]
fn host_calls_per_request_at_512_workers() {
    let workers: Vec<String> = (0..512)
        .map(|i| {
            format!(
                r#"{{"address":"10.0.{}.{}:30000","dp_size":8}}"#,
                i / 250,
                i % 250 + 1
            )
        })
        .collect();
    let count = |extra: &str| {
        let c = Rc::new(
            Config::from_json(
                format!(
                    r#"{{"workers":[{}],"rank_transport":"header","prefix_affinity":false{extra}}}"#,
                    workers.join(",")
                )
                .as_bytes(),
            )
            .unwrap(),
        );
        let h = FakeHost::default();
        h.now.set(10_000);
        for i in 0..512 {
            crate::shared_data::testing::poll(&c, &h, i, &[100; 8]);
        }
        let post = [
            (":method", "POST"),
            (":path", "/generate"),
            ("content-length", "400"),
        ];
        calls_per_request(&c, &h, &post, b"")
    };
    // Every state read: 512 reads, and the 15 of a 2-worker fleet less its 2.
    assert_eq!(count(r#","state_reads":"every_worker""#), 512 + 13);
    // The default there, the change log: its read instead of the 512, and
    // the worker this VM wrote read back; the estimate's log entry, 1 call
    // (a compare-and-swap onto the log as read for the choice); the
    // release's, 2 (the log read again, then written).
    assert_eq!(count(""), 13 + 1 + 1 + 1 + 2);
}

#[test]
fn header_mode_ejects_probes_retries_and_attributes_like_body_mode() {
    let (c, h) = fleet(r#","rank_transport":"header","passive_health":{"probe_share":1.0}"#);
    // One VM: its cached health record must follow what its own requests wrote.
    let routing = Rc::new(Routing::new(c.clone(), 0));
    let ended = |code: u64, details: &str, upstream: &str, attempts: u64| {
        let mut r = Request::new(routing.clone());
        post(&h, "/generate", br#"{"text":"x"}"#, &[]);
        assert_eq!(r.on_request_headers(&h, false), Action::Continue);
        let route = h.header("x-dprank-endpoint").unwrap_or_default();
        let rank = h.header("x-data-parallel-rank").unwrap_or_default();
        h.finish_request(code, details, Some(upstream), attempts);
        r.on_done(&h);
        (route, rank)
    };
    // b's rank 2 is the least loaded; a has a rank 2 too, so it is b's alternate.
    assert_eq!(
        ended(200, "via_upstream", "127.0.0.1:2", 1),
        ("127.0.0.1:2,127.0.0.1:1".into(), "2".into())
    );
    // b answers 500s: the rank in the header is the rank that failed.
    for _ in 0..5 {
        ended(500, "via_upstream", "127.0.0.1:2", 1);
    }
    assert_eq!(h.counter("dprank.ejections.b"), 1);
    assert_eq!(h.counter("dprank.rank_ejections.b"), 1);
    // b is out: a's least-loaded rank, with no alternate.
    assert_eq!(
        ended(200, "via_upstream", "127.0.0.1:1", 1),
        ("127.0.0.1:1".into(), "1".into())
    );
    // After the cooldown b is probed (share 1.0), answers, and is back.
    h.now.set(h.now.get() + 10_000);
    crate::shared_data::testing::poll(&c, &h, 0, &[100, 50, 100, 100]);
    crate::shared_data::testing::poll(&c, &h, 1, &[100, 100, 20, 100]);
    let (probe, _) = ended(200, "via_upstream", "127.0.0.1:2", 1);
    assert!(probe.starts_with("127.0.0.1:2"), "{probe}");
    assert_eq!(
        ended(200, "via_upstream", "127.0.0.1:2", 1).0,
        "127.0.0.1:2,127.0.0.1:1"
    );
    assert_eq!(h.gauge_value("dprank.health.b"), Some(0));
    // b refuses; Envoy's retry lands on a with the same rank headers.
    let refused = "upstream_reset_before_response_started{connection_failure}";
    ended(200, "via_upstream", "127.0.0.1:1", 2);
    assert_eq!(h.counter("dprank.retry.to_alternate"), 1);
    assert_eq!(h.counter("dprank.failures.b"), 5 + 1);
    assert_eq!(h.counter("dprank.failures.a"), 0);
    // Both refuse and nothing is in rotation: header mode passes to the
    // fallback policy (no rank header), whose pick still counts.
    for _ in 0..5 {
        ended(503, refused, "127.0.0.1:1", 3);
    }
    let (route, rank) = ended(503, refused, "127.0.0.1:1", 1);
    assert_eq!((route.as_str(), rank.as_str()), ("", ""));
    assert_eq!(h.counter("dprank.passthrough.none_in_rotation"), 1);
    assert_eq!(h.counter("dprank.failures.a"), 5 + 1);
}

/// A chat request whose first message is a long system prompt shared by
/// every request with the same `system`, then `question`.
fn chat(system: &str, question: &str) -> Vec<u8> {
    format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"{question}"}}],"stream":true}}"#,
        system.repeat(400)
    )
    .into_bytes()
}

#[test]
fn header_mode_under_prefix_affinity_decides_at_the_end_of_the_body_and_never_changes_it() {
    let (c, h) = fleet(r#","engine":"vllm""#);
    let mut r = request(&c);
    let body = chat("You are terse. ", "hello");
    post(&h, "/v1/chat/completions", &body, &CLIENT_RANK);
    assert_eq!(
        r.on_request_headers(&h, false),
        Action::Pause,
        "waits for the prompt"
    );
    for (name, _) in CLIENT_RANK {
        assert_eq!(h.header(name), None, "{name}");
    }
    assert_eq!(r.on_request_body(&h, body.len(), true), Action::Continue);
    assert_eq!(
        h.header("x-dprank-endpoint").as_deref(),
        Some("127.0.0.1:2,127.0.0.1:1")
    );
    assert_eq!(h.header("x-data-parallel-rank").as_deref(), Some("2"));
    assert_eq!(
        h.header("x-override-routed-dp-rank"),
        None,
        "vLLM reads one header"
    );
    assert_eq!(h.request_body.borrow().as_slice(), body, "byte for byte");
    assert_eq!(h.header("content-length"), Some(body.len().to_string()));
    assert_eq!(
        (h.host_calls("request_body"), h.host_calls("replace_request_body")),
        (1, 0)
    );
    let state = |i: usize| read_worker_states(&c, &h)[i].clone().unwrap();
    let prompt = state(1).pending_total();
    assert!(prompt > 1000, "the prompt's estimate: {prompt}");
    assert_eq!(state(1).prefill.queued(2, QueueMeasure::Local).requests, 1);
    // The first streamed byte ends its prefill; its end gives the estimate back.
    assert_eq!(r.on_response_headers(&h), Action::Continue);
    assert_eq!(r.on_response_body(&h, 0), Action::Continue);
    assert_eq!(state(1).prefill.queued(2, QueueMeasure::Local).requests, 0);
    r.on_done(&h);
    assert_eq!(pending(&c, &h), 0);
    // The prompt went into b/2's index: the same system prompt follows it
    // there, though a/1 now has less load.
    poll(&c, &h, 0, &[100, 0, 100, 100]);
    let mut again = request(&c);
    post(
        &h,
        "/v1/chat/completions",
        &chat("You are terse. ", "and now?"),
        &[],
    );
    send(&mut again, &h);
    assert_eq!(h.header("x-data-parallel-rank").as_deref(), Some("2"));
    assert_eq!(
        h.header("x-dprank-endpoint").as_deref().map(|r| &r[..11]),
        Some("127.0.0.1:2")
    );
    let mut other = request(&c);
    post(
        &h,
        "/v1/chat/completions",
        &chat("Answer in French. ", "bonjour"),
        &[],
    );
    send(&mut other, &h);
    assert_eq!(
        (
            h.header("x-dprank-endpoint").as_deref().map(|r| &r[..11]),
            h.header("x-data-parallel-rank").as_deref()
        ),
        (Some("127.0.0.1:1"), Some("1")),
        "another prompt goes by load"
    );
}

#[test]
fn header_mode_under_prefix_affinity_routes_unreadable_bodies_by_load() {
    let (c, h) = fleet(r#","engine":"vllm","fail_mode":"closed""#);
    // Not JSON: the server's to refuse; routed by its length, untouched.
    let mut r = request(&c);
    let body = b"{\"messages\": [oops";
    post(&h, "/v1/completions", body, &[]);
    assert_eq!(send(&mut r, &h), (Action::Pause, Action::Continue));
    assert_eq!(h.header("x-data-parallel-rank").as_deref(), Some("2"));
    assert_eq!(h.request_body.borrow().as_slice(), body);
    assert_eq!(pending(&c, &h), (body.len() as u64).div_ceil(4));
    r.on_done(&h);
    // Compressed: it cannot be read, so it is routed from the headers.
    let mut r = request(&c);
    post(
        &h,
        "/v1/completions",
        b"\x1f\x8b\x08",
        &[("content-encoding", "gzip")],
    );
    assert_eq!(r.on_request_headers(&h, false), Action::Continue);
    assert_eq!(h.header("x-data-parallel-rank").as_deref(), Some("2"));
    assert_eq!(h.host_calls("request_body"), 1, "only the first request's");
    r.on_done(&h);
    assert!(h.replies.borrow().is_empty());
    // No fresh data: refused at the end of the body in closed mode.
    h.now.set(10_000 + c.stale_after_ms + 1);
    let mut r = request(&c);
    post(&h, "/v1/completions", br#"{"prompt":"x"}"#, &[]);
    assert_eq!(send(&mut r, &h), (Action::Pause, Action::Pause));
    assert_eq!(reply_status(&h), vec![503]);
    assert_eq!(h.header("x-data-parallel-rank"), None);
}

#[test]
fn header_mode_tells_the_server_the_class_priority_and_drops_the_clients() {
    let (c, h) =
        fleet(r#","rank_transport":"header","admission":{"server_priority":{"critical":1,"sheddable":-1}}"#);
    let header_after = |class: Option<&str>| {
        let mut r = request(&c);
        let mut extra = vec![("x-override-priority", "99")];
        if let Some(class) = class {
            extra.push(("x-dprank-priority", class));
        }
        post(&h, "/generate", br#"{"text":"hi"}"#, &extra);
        send(&mut r, &h);
        assert_eq!(h.header("x-data-parallel-rank").as_deref(), Some("2"));
        h.header("x-override-priority")
    };
    assert_eq!(header_after(Some("critical")).as_deref(), Some("1"));
    assert_eq!(header_after(Some("sheddable")).as_deref(), Some("-1"));
    assert_eq!(
        header_after(None),
        None,
        "the default class has none: the client's is gone"
    );
}

#[test]
fn a_body_the_proxy_will_not_hand_over_passes_unrouted_or_is_refused_when_closed() {
    let (c, h) = fleet("");
    h.refuse("request_body", HostError::BAD_ARGUMENT);
    let mut r = request(&c);
    post(&h, "/generate", br#"{"text":"x"}"#, &[]);
    assert_eq!(send(&mut r, &h), (Action::Pause, Action::Continue));
    assert_eq!(h.counter("dprank.passthrough.host_refused"), 1);
    assert_eq!(h.header("x-dprank-endpoint"), None, "not routed");
    r.on_done(&h);
    assert_eq!(pending(&c, &h), 0);

    let (c, h) = fleet(r#","fail_mode":"closed""#);
    h.refuse("request_body", HostError::BAD_ARGUMENT);
    let mut r = request(&c);
    post(&h, "/generate", br#"{"text":"x"}"#, &[]);
    assert_eq!(send(&mut r, &h), (Action::Pause, Action::Pause));
    assert_eq!(reply_status(&h), vec![503]);
    assert_eq!(h.counter("dprank.rejected.host_refused"), 1);
}

#[test]
fn headers_the_proxy_will_not_hand_over_or_strip_are_never_routed_on() {
    // Unreadable: passed on unrouted.
    let (c, h) = fleet("");
    h.refuse("request_headers", HostError::BAD_ARGUMENT);
    let mut r = request(&c);
    post(&h, "/generate", br#"{"text":"x"}"#, &[]);
    assert_eq!(r.on_request_headers(&h, false), Action::Continue);
    assert_eq!(h.counter("dprank.passthrough.host_refused"), 1);
    // A client routing header that cannot be removed: refused, never forwarded.
    let (c, h) = fleet("");
    h.refuse("remove_request_header", HostError::BAD_ARGUMENT);
    let mut r = request(&c);
    post(
        &h,
        "/generate",
        br#"{"text":"x"}"#,
        &[("x-dprank-endpoint", "10.9.9.9:1")],
    );
    assert_eq!(r.on_request_headers(&h, false), Action::Pause);
    assert_eq!(reply_status(&h), vec![503]);
}

#[test]
fn a_prefill_leg_without_an_answer_or_an_unreadable_one_is_a_clean_502() {
    // No headers: Envoy's way of saying the call was reset or cut short.
    let (c, h, mut r) = pd_request("");
    *h.callout.borrow_mut() = (Some(200), b"{}".to_vec());
    r.on_prefill_response(&h, 0, 0);
    assert_eq!(reply_status(&h), vec![502]);
    assert!(String::from_utf8_lossy(&h.replies.borrow()[0].2).contains("did not answer"));
    assert_eq!(h.counter("dprank.prefill_failed.p0"), 1);
    r.on_done(&h);
    assert_eq!(pending(&c, &h), 0);
    // Headers the proxy refuses to hand over.
    let (_, h, mut r) = pd_request("");
    h.refuse("callout_response", HostError::BAD_ARGUMENT);
    r.on_prefill_response(&h, 3, 2);
    assert_eq!(reply_status(&h), vec![502]);
    // A decode response whose stream went while it waited: not resumed, counted.
    let (_, h, mut r) = pd_request("");
    assert_eq!(r.on_response_headers(&h), Action::Pause);
    h.refuse("resume_response", HostError::BAD_ARGUMENT);
    *h.callout.borrow_mut() = (Some(200), b"{}".to_vec());
    r.on_prefill_response(&h, 1, 2);
    assert_eq!(h.counter("dprank.host_refused.resume_response"), 1);
    assert_eq!(h.counter("dprank.prefill_ok.p0"), 1);
}

/// The upstream at `route` (the route header's first host) answers 400 with `body`.
fn answered_400(h: &FakeHost, route: &str, body: &[u8]) {
    let host = route.split(',').next().unwrap_or_default();
    h.properties
        .borrow_mut()
        .insert("upstream.address".into(), host.as_bytes().to_vec());
    *h.response.borrow_mut() = (Some(400), body.to_vec());
}

/// worker b names its ranks 4..7 (node 2 of a DP-8 deployment).
fn second_node(c: &Config, h: &FakeHost) {
    shared_data::update_worker(c, h, 1, shared_data::IfMissing::Skip, |s| {
        s.first_rank = 4;
        Some(())
    })
    .unwrap();
}

/// A routed request's rank header, its (local) rank index and its worker.
fn header_request(c: &Rc<Config>, h: &FakeHost) -> (Request, Option<String>, String) {
    let mut r = request(c);
    post(h, "/v1/completions", br#"{"prompt":"x"}"#, &[]);
    assert_eq!(r.on_request_headers(h, false), Action::Continue);
    let route = h.header("x-dprank-endpoint").unwrap();
    (r, h.header("x-data-parallel-rank"), route)
}

#[test]
fn a_worker_refusing_the_rank_value_teaches_the_numbering_it_reads() {
    // Configured global: worker b's rank 2 is written 6 (routed counter rank_6).
    let (c, h) = fleet(
        r#","rank_transport":"header","rank_headers":["x-data-parallel-rank"],"rank_numbering":"global""#,
    );
    second_node(&c, &h);
    let (mut r, value, route) = header_request(&c, &h);
    assert!(route.starts_with("127.0.0.1:2"), "{route}");
    assert_eq!(value.as_deref(), Some("6"));
    assert_eq!(h.counter("dprank.routed.b.rank_6"), 1);
    // vLLM's Python frontend answers 400, naming its local range.
    answered_400(
        &h,
        &route,
        br#"{"error":{"message":"data_parallel_rank 6 is out of range [0, 4).","type":"BadRequestError"}}"#,
    );
    r.on_response_headers(&h);
    r.on_response_body(&h, 200);
    assert_eq!(h.counter("dprank.rank_refused.b"), 1);
    r.on_done(&h);
    // Every later request carries the local index; a success reads no body.
    *h.response.borrow_mut() = (Some(200), b"{}".to_vec());
    let (mut r, value, _) = header_request(&c, &h);
    assert_eq!(value.as_deref(), Some("2"));
    r.on_response_headers(&h);
    let reads = h.host_calls("response_body");
    r.on_response_body(&h, 2);
    assert_eq!(h.host_calls("response_body"), reads, "only a 400 is read");
    assert_eq!(h.counter("dprank.rank_refused.b"), 1, "learned once");

    // The Rust frontend refuses a local index: global it is.
    let (c, h) = fleet(r#","rank_transport":"header","rank_headers":["x-data-parallel-rank"]"#);
    second_node(&c, &h);
    let (mut r, value, route) = header_request(&c, &h);
    assert_eq!(value.as_deref(), Some("2"), "local by default");
    answered_400(
        &h,
        &route,
        br#"{"error":{"message":"data parallel rank 2 is out of range for 4 engine(s)"}}"#,
    );
    r.on_response_headers(&h);
    r.on_response_body(&h, 100);
    let (_, value, _) = header_request(&c, &h);
    assert_eq!(value.as_deref(), Some("6"));
}

#[test]
fn a_worker_restarted_with_fewer_ranks_loses_them_at_its_first_refusal() {
    let (c, h) = fleet("");
    // b's rank 2 is the lowest: written in the body.
    let mut r = request(&c);
    post(&h, "/generate", br#"{"text":"x"}"#, &[]);
    send(&mut r, &h);
    assert_eq!(json(&h.request_body.borrow())["routed_dp_rank"], 2);
    let route = h.header("x-dprank-endpoint").unwrap();
    // A retry's 400 (from another host) says nothing about b.
    answered_400(
        &h,
        "127.0.0.1:1",
        br#"{"error":"routed_dp_rank must be in [0, 2)"}"#,
    );
    r.on_response_headers(&h);
    r.on_response_body(&h, 100);
    r.on_done(&h);
    assert_eq!(h.counter("dprank.rank_refused.b"), 0);
    // b's own 400 names its two ranks.
    let mut r = request(&c);
    post(&h, "/generate", br#"{"text":"x"}"#, &[]);
    send(&mut r, &h);
    assert_eq!(json(&h.request_body.borrow())["routed_dp_rank"], 2);
    answered_400(&h, &route, br#"{"error":"routed_dp_rank must be in [0, 2)"}"#);
    r.on_response_headers(&h);
    r.on_response_body(&h, 100);
    r.on_done(&h);
    assert_eq!(h.counter("dprank.rank_refused.b"), 1);
    // Until its next poll, b has ranks 0 and 1 only: a's rank 1 (50) wins.
    let mut r = request(&c);
    post(&h, "/generate", br#"{"text":"x"}"#, &[]);
    send(&mut r, &h);
    assert_eq!(json(&h.request_body.borrow())["routed_dp_rank"], 1);
    assert!(h.header("x-dprank-endpoint").unwrap().starts_with("127.0.0.1:1"));
}

#[test]
fn a_server_of_one_engine_gets_no_rank_header_and_alternates_share_the_value() {
    let c = Rc::new(
        Config::from_json(
            br#"{"workers":[{"address":"127.0.0.1:1","name":"a"},{"address":"127.0.0.1:2","name":"b"},{"address":"127.0.0.1:3","name":"c"}],
                "poll_cluster":"p","rank_transport":"header","rank_headers":["x-data-parallel-rank"],"rank_numbering":"global"}"#,
        )
        .unwrap(),
    );
    let h = FakeHost::default();
    h.now.set(10_000);
    // a: engine 3 alone (external load balancing); b, c: engines 4..5 and 0..1.
    poll(&c, &h, 0, &[10]);
    poll(&c, &h, 1, &[100, 50]);
    poll(&c, &h, 2, &[100, 60]);
    shared_data::update_worker(&c, &h, 0, shared_data::IfMissing::Skip, |s| {
        s.first_rank = 3;
        Some(())
    });
    second_node(&c, &h);
    let (_, value, route) = header_request(&c, &h);
    assert_eq!(
        (value, route.as_str()),
        (None, "127.0.0.1:1"),
        "one engine: no header"
    );
    // a busy: b's engine 5 (value 5); c's rank 1 is value 1, no alternate for it.
    poll(&c, &h, 0, &[1000]);
    let (_, value, route) = header_request(&c, &h);
    assert_eq!((value.as_deref(), route.as_str()), (Some("5"), "127.0.0.1:2"));
}

#[test]
fn a_worker_with_a_port_per_rank_gets_each_request_at_its_rank_port_without_a_rank_value() {
    let c = Rc::new(
        Config::from_json(
            br#"{"workers":[{"address":"127.0.0.1:30000","name":"node","dp_size":4,"rank_ports":true},
                {"address":"127.0.0.1:40000","name":"other","dp_size":4,"rank_ports":true}],"poll_cluster":"p","prefix_affinity":false}"#,
        )
        .unwrap(),
    );
    let h = FakeHost::default();
    h.now.set(10_000);
    poll(&c, &h, 0, &[100, 100, 5, 100]);
    poll(&c, &h, 1, &[100, 100, 50, 100]);
    let mut r = request(&c);
    post(&h, "/generate", br#"{"text":"x","routed_dp_rank":3}"#, &[]);
    send(&mut r, &h);
    // Rank 2's port, then the other worker's rank 2 port for retries.
    assert_eq!(
        h.header("x-dprank-endpoint").as_deref(),
        Some("127.0.0.1:30002,127.0.0.1:40002")
    );
    assert_eq!(
        json(&h.request_body.borrow())["routed_dp_rank"],
        serde_json::Value::Null,
        "the port selects the rank"
    );
    assert_eq!(h.counter("dprank.routed.node.rank_2"), 1);
    // A failure at the rank port counts against its worker's rank.
    h.finish_request(503, "via_upstream", Some("127.0.0.1:30002"), 1);
    r.on_done(&h);
    assert_eq!(h.counter("dprank.failures.node"), 1, "counted against its worker");
    let recorded = format!("{:?}", shared_data::read_health(&c, &h));
    assert!(
        recorded.contains("30000") && !recorded.contains("30002"),
        "under the worker's address: {recorded}"
    );
}

#[test]
fn a_streamed_answer_is_timed_on_its_rank_unless_delivery_timing_is_off() {
    for (extra, timed) in [("", true), (r#","delivery_timing":false"#, false)] {
        let (c, h) = fleet(extra);
        let mut r = request(&c);
        post(&h, "/generate", br#"{"text":"hi","stream":true}"#, &[]);
        send(&mut r, &h);
        *h.response.borrow_mut() = (Some(200), b"data: {}\n\n".to_vec());
        h.response_headers
            .replace(vec![("content-type".into(), "text/event-stream".into())]);
        r.on_response_headers(&h);
        for _ in 0..3 {
            r.on_response_body(&h, 10);
        }
        r.on_done(&h);
        let recorded: Vec<String> = h
            .histograms
            .borrow()
            .keys()
            .filter(|k| k.starts_with("dprank.delivered."))
            .cloned()
            .collect();
        assert_eq!(recorded.len(), if timed { 2 } else { 0 }, "{extra}: {recorded:?}");
        assert!(
            recorded.iter().all(|k| k.contains(".rank_")),
            "per (worker, rank): {recorded:?}"
        );
    }
}
