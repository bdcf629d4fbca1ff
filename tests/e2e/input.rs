//! Input the filter does not route, and client attempts to steer routing.

use crate::common::http::raw_exchange;
use crate::common::{EnvoyOptions, Reply, World};
use flate2::write::GzEncoder;
use flate2::Compression;
use serde_json::json;
use std::io::Write;
use std::time::Duration;

const LISTENER_BUFFER_LIMIT: u64 = 1 << 20;

/// worker_a rank 1 is the clear minimum; worker_b holds the lowest rank 3.
fn loads() -> Vec<serde_json::Value> {
    World::base_tokens(&[&[5000, 1000, 5000, 7000], &[6000, 6000, 6000, 2000]])
}

fn post_raw(world: &World, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    world.client.post(&world.envoy.url(path), headers, body)
}

/// Asserts the worker that answered received exactly `body` on `path`.
fn assert_untouched(world: &World, reply: &Reply, path: &str, body: &[u8]) {
    let recorded = world.sim_of(reply).last_request();
    assert_eq!((recorded.method.as_str(), recorded.path.as_str()), ("POST", path));
    assert_eq!(recorded.status, Some(u64::from(reply.status)));
    assert!(
        recorded.body == body,
        "{path}: body changed: sent {:?}, received {:?}",
        String::from_utf8_lossy(body),
        String::from_utf8_lossy(&recorded.body)
    );
}

#[test]
fn unroutable_input_passes_through_untouched() {
    let world = World::start(
        "bad_input",
        2,
        &["--instant"],
        &loads(),
        EnvoyOptions {
            listener_buffer_limit: Some(LISTENER_BUFFER_LIMIT),
            ..EnvoyOptions::default()
        },
    );
    let json_ct = [("content-type", "application/json")];

    // Not JSON: untouched (the worker itself answers 400).
    let body = br#"{"text": "unterminated"#;
    let reply = post_raw(&world, "/generate", &json_ct, body);
    assert_eq!(reply.status, 400, "the worker's own answer: {reply:?}");
    assert_untouched(&world, &reply, "/generate", body);
    assert_eq!(world.envoy.stat("passthrough.not_json"), 1);

    // A JSON array: untouched.
    let body = br#"[{"text":"a","routed_dp_rank":3}]"#;
    let reply = post_raw(&world, "/generate", &json_ct, body);
    assert_untouched(&world, &reply, "/generate", body);
    assert_eq!(world.envoy.stat("passthrough.not_object"), 1);

    // No body.
    let reply = post_raw(&world, "/generate", &json_ct, b"");
    assert_untouched(&world, &reply, "/generate", b"");
    assert_eq!(world.envoy.stat("passthrough.empty_body"), 1);

    // A GET.
    let reply = world.client.get(&world.envoy.url("/v1/models"), &[]);
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["data"][0]["owned_by"], "sglang");
    assert_eq!(world.envoy.stat("passthrough.method"), 1);

    // Unknown path, and a serving path the config leaves out: untouched, the
    // client's own rank field included.
    let reply = post_raw(&world, "/v1/embeddings", &json_ct, br#"{"input":"x"}"#);
    assert_eq!(reply.status, 404, "{reply:?}");
    assert!(reply.header("x-sim-worker").is_some(), "answered by a worker");
    let body = br#"{ "prompt":"x", "max_tokens":1, "routed_dp_rank":3 }"#;
    let reply = post_raw(&world, "/v1/completions", &json_ct, body);
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_untouched(&world, &reply, "/v1/completions", body);
    assert_eq!(reply.rank(), 3, "the unrouted path keeps the client's choice");
    assert_eq!(world.envoy.stat("passthrough.path"), 2);

    // content-encoding: the filter cannot read the body, so it leaves it alone.
    let mut gzip = GzEncoder::new(Vec::new(), Compression::default());
    gzip.write_all(br#"{"text":"compressed","routed_dp_rank":3}"#)
        .unwrap();
    let body = gzip.finish().unwrap();
    let reply = post_raw(
        &world,
        "/generate",
        &[("content-type", "application/json"), ("content-encoding", "gzip")],
        &body,
    );
    assert_untouched(&world, &reply, "/generate", &body);
    let recorded = world.sim_of(&reply).last_request();
    assert_eq!(recorded.header("content-encoding"), Some("gzip"));
    assert_eq!(world.envoy.stat("passthrough.content_encoding"), 1);

    // Nothing above was routed or rejected.
    let stats = world.envoy.stats();
    assert!(
        !stats
            .keys()
            .any(|k| k.starts_with("routed.") || k.starts_with("rejected.")),
        "{stats:?}"
    );

    // Bodies are buffered whole, up to the listener's limit; beyond it, 413.
    // 600 KB: under the limit, and within the worker's KV capacity.
    let text = "y".repeat(600_000);
    let reply = world.post("/generate", &json!({"text": text}).to_string());
    assert_eq!(reply.status, 200, "a body under the limit is routed");
    assert_eq!(world.served_by(&reply), ("worker_a".to_string(), 1));
    let too_big = vec![b'z'; 2 * LISTENER_BUFFER_LIMIT as usize];
    let head = format!(
        "POST /generate HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json\r\ncontent-length: {}",
        too_big.len() + 12
    );
    let reply = raw_exchange(
        world.envoy.listener,
        &head,
        &[b"{\"text\":\"", &too_big, b"\"}"],
        Duration::ZERO,
    );
    assert_eq!(reply.status, 413, "{reply:?}");
}

#[test]
fn clients_cannot_steer_routing() {
    let world = World::start("bad_input", 2, &["--instant"], &loads(), EnvoyOptions::default());
    let b_addr = world.sim("worker_b").addr.to_string();

    // A client-sent route header neither steers nor reaches the worker.
    let reply = world.client.post(
        &world.envoy.url("/generate"),
        &[
            ("content-type", "application/json"),
            ("x-dprank-endpoint", &b_addr),
        ],
        br#"{"text":"steer"}"#,
    );
    assert_eq!(world.served_by(&reply), ("worker_a".to_string(), 1));
    let recorded = world.sim("worker_a").last_request();
    // (The filter's own value, the worker's address, goes upstream with it.)
    assert_ne!(recorded.header("x-dprank-endpoint"), Some(b_addr.as_str()));
    // Also when the filter does not route (the cluster's round robin picks).
    let mut served_by = Vec::new();
    for _ in 0..6 {
        let reply = world.client.post(
            &world.envoy.url("/generate"),
            &[
                ("content-type", "application/json"),
                ("x-dprank-endpoint", &b_addr),
            ],
            b"not json",
        );
        let sim = world.sim_of(&reply);
        let recorded = sim.last_request();
        assert_eq!(
            recorded.header("x-dprank-endpoint"),
            None,
            "the client's route header is stripped"
        );
        served_by.push(sim.name.clone());
    }
    assert!(
        served_by.iter().any(|w| w == "worker_a"),
        "a client route header naming worker_b must not steer: {served_by:?}"
    );

    // Client rank fields are overwritten (keep_client_rank is off), in place.
    let reply = world.post(
        "/generate",
        r#"{"text":"x","routed_dp_rank":3,"data_parallel_rank": 2}"#,
    );
    assert_eq!(world.served_by(&reply), ("worker_a".to_string(), 1));
    // The alias may carry the same rank or null (= let the server decide): no
    // client value survives, and nothing else changes.
    let received = world.sim("worker_a").last_request().body_text().to_string();
    assert!(
        [
            r#"{"text":"x","routed_dp_rank":1,"data_parallel_rank": 1}"#,
            r#"{"text":"x","routed_dp_rank":1,"data_parallel_rank": null}"#,
        ]
        .contains(&received.as_str()),
        "client rank fields must be overwritten in place: {received}"
    );

    // Without pin_header configured a pin header is just a header.
    let reply = world.client.post(
        &world.envoy.url("/generate"),
        &[
            ("content-type", "application/json"),
            ("x-dprank-pin", "worker_b/3"),
        ],
        br#"{"text":"pin?"}"#,
    );
    assert_eq!(world.served_by(&reply), ("worker_a".to_string(), 1));
    assert_eq!(
        world.sim("worker_a").last_request().header("x-dprank-pin"),
        Some("worker_b/3")
    );
    assert_eq!(world.envoy.stat("pin_ignored"), 0);
}

#[test]
fn trusted_client_rank_and_pin_header() {
    let world = World::start(
        "trusted_client",
        2,
        &["--instant"],
        &loads(),
        EnvoyOptions::default(),
    );
    let b_addr = world.sim("worker_b").addr.to_string();

    // A kept rank: the body is not touched, the worker is the one least loaded at that rank.
    for body in [
        r#"{"text":"mine", "routed_dp_rank":3}"#,
        r#"{"data_parallel_rank":3,"text":"legacy name"}"#,
    ] {
        let reply = world.post("/generate", body);
        assert_eq!(world.served_by(&reply), ("worker_b".to_string(), 3), "{body}");
        assert_eq!(world.sim("worker_b").last_request().body_text(), body);
    }
    // Not an integer: not trusted, routed as usual and overwritten.
    let reply = world.post("/generate", r#"{"text":"x","routed_dp_rank":"3"}"#);
    assert_eq!(world.served_by(&reply), ("worker_a".to_string(), 1));
    assert_eq!(
        world.sim("worker_a").last_request().body_text(),
        r#"{"text":"x","routed_dp_rank":1}"#
    );
    // No rank: routed as usual.
    let reply = world.post("/generate", r#"{"text":"x"}"#);
    assert_eq!(world.served_by(&reply), ("worker_a".to_string(), 1));

    // The pin header picks a fresh (worker, rank), by name or address, and is stripped.
    for (pin, expected) in [
        ("worker_b/2".to_string(), ("worker_b", 2)),
        (format!("{b_addr}/0"), ("worker_b", 0)),
    ] {
        let reply = world.client.post(
            &world.envoy.url("/generate"),
            &[("content-type", "application/json"), ("x-dprank-pin", &pin)],
            br#"{"text":"pinned"}"#,
        );
        assert_eq!(
            world.served_by(&reply),
            (expected.0.to_string(), expected.1),
            "pin {pin}"
        );
        let recorded = world.sim(expected.0).last_request();
        assert_eq!(recorded.header("x-dprank-pin"), None, "pin header stripped");
        assert_eq!(recorded.body_json()["routed_dp_rank"], json!(expected.1));
    }
    // A pin naming no fresh rank is ignored and counted.
    let reply = world.client.post(
        &world.envoy.url("/generate"),
        &[
            ("content-type", "application/json"),
            ("x-dprank-pin", "worker_b/9"),
        ],
        br#"{"text":"pinned"}"#,
    );
    assert_eq!(world.served_by(&reply), ("worker_a".to_string(), 1));
    assert_eq!(world.envoy.stat("pin_ignored"), 1);
}

#[test]
fn fail_closed_answers_json_errors() {
    let world = World::start_with_failing_polls("fail_closed");
    let assert_error = |reply: &Reply, status: u16| {
        assert_eq!(reply.status, status, "{reply:?}");
        assert_eq!(reply.header("content-type"), Some("application/json"));
        assert!(
            reply.json()["error"]["message"].is_string(),
            "an OpenAI-style error: {reply:?}"
        );
        assert!(reply.header("x-sim-worker").is_none(), "answered by the filter");
    };

    assert_error(&world.post("/generate", r#"{"text":"x"}"#), 503);
    assert_eq!(world.envoy.stat("rejected.no_fresh_data"), 1);
    assert_error(&world.post("/generate", "not json"), 400);
    assert_eq!(world.envoy.stat("rejected.not_json"), 1);
    assert_error(&world.post("/v1/chat/completions", "[1,2]"), 400);
    assert_eq!(world.envoy.stat("rejected.not_object"), 1);
    for sim in &world.sims {
        assert!(
            sim.requests().is_empty(),
            "{} received a rejected request",
            sim.name
        );
    }
    // What the filter does not route still passes.
    assert_eq!(world.client.get(&world.envoy.url("/v1/models"), &[]).status, 200);

    // Once polls succeed, requests are routed again.
    for sim in &world.sims {
        sim.set_load_fault("none");
    }
    world.wait_for_first_polls();
    let reply = world.post("/generate", r#"{"text":"x"}"#);
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_error(&world.post("/generate", "still not json"), 400);
}
