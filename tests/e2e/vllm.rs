//! vLLM (`engine: vllm`, the shipped `envoy/vllm.yaml`, scenario `vllm`)
//! against vLLM-shaped workers (`dprank-sim --engine vllm`): the engine
//! travels in `x-data-parallel-rank` and serves, the body is never rewritten,
//! the OpenAI Python client works on chat and completions, streamed and not,
//! a repeated prompt returns to the engine that cached it, and hostile
//! `/metrics` answers cost only their worker its freshness.

use crate::common::http::{raw_exchange, Reply};
use crate::common::sim::Recorded;
use crate::common::{wait_until, EnvoyOptions, World};
use crate::header::openai_client;
use std::time::Duration;

/// vLLM's scheduler on a dense 8B model, ten times faster than real.
const VLLM: [&str; 7] = [
    "--engine",
    "vllm",
    "--cost-model",
    "dense-8b",
    "--time-scale",
    "10",
    "--enable-prompt-tokens-details",
];

fn options() -> EnvoyOptions {
    EnvoyOptions {
        shipped: "envoy/vllm.yaml",
        ..EnvoyOptions::default()
    }
}

fn start(extra: &[&str]) -> World {
    let args: Vec<&str> = VLLM.iter().chain(extra).copied().collect();
    World::start("vllm", 2, &args, &[], options())
}

/// The worker saw dprank's engine in `x-data-parallel-rank` alone, served
/// the request on it, and got the client's JSON without a rank field.
fn assert_pinned(request: &Recorded, what: &str) {
    let header = request.header("x-data-parallel-rank");
    let rank: u64 = header
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("{what}: x-data-parallel-rank {header:?}"));
    assert!(rank < 4, "{what}: engine {rank}");
    assert_eq!(request.rank, Some(rank), "{what}: served on the header's engine");
    for name in [
        "x-override-routed-dp-rank",
        "x-override-bootstrap-room",
        "x-override-bootstrap-host",
    ] {
        assert_eq!(request.header(name), None, "{what}: {name} reached the worker");
    }
    assert!(
        request.header("x-dprank-endpoint").is_some(),
        "{what}: not routed"
    );
    let body = request.body_json();
    for field in ["data_parallel_rank", "routed_dp_rank", "dp_rank"] {
        assert!(body.get(field).is_none(), "{what}: {field} written into the body");
    }
}

fn routed_total(world: &World) -> u64 {
    world
        .envoy
        .stats()
        .iter()
        .filter(|(k, _)| k.starts_with("routed."))
        .map(|(_, v)| v)
        .sum()
}

#[test]
fn vllm_the_openai_client_works_on_chat_and_completions_streamed_and_not() {
    let world = start(&[]);
    let result = openai_client(&world.envoy.url("/v1"));
    for (call, tokens) in [("chat", 8), ("completion", 8)] {
        assert!(
            result[call]["text"].as_str().is_some_and(|t| !t.is_empty()),
            "{call}: {result}"
        );
        assert_eq!(result[call]["completion_tokens"], tokens, "{call}: {result}");
    }

    let recorded: Vec<Recorded> = world.sims.iter().flat_map(|s| s.requests()).collect();
    assert_eq!(recorded.len(), 4, "{recorded:?}");
    for request in &recorded {
        assert_pinned(request, &request.path);
        assert!(
            request
                .header("user-agent")
                .is_some_and(|ua| ua.contains("OpenAI")),
            "{request:?}"
        );
    }
    let paths = |p: &str| recorded.iter().filter(|r| r.path == p).count();
    assert_eq!(paths("/v1/chat/completions"), 2);
    assert_eq!(paths("/v1/completions"), 2);
    assert_eq!(
        recorded
            .iter()
            .filter(|r| r.body_json()["stream"] == true)
            .count(),
        2
    );
    assert_eq!(routed_total(&world), 4);
}

#[test]
fn vllm_bodies_arrive_byte_for_byte_and_a_repeated_prompt_returns_to_its_engine() {
    let world = start(&[]);
    // Whitespace, unicode, escapes, a key order a re-serialising proxy would not keep.
    let bodies: [(&str, &[u8]); 2] = [
        (
            "/v1/completions",
            "{\"prompt\":\"\u{65e5}\u{672c}\u{8a9e} \\\"q\\\"\",\"max_tokens\":2,\"b\":[],\"a\":{}}"
                .as_bytes(),
        ),
        (
            "/v1/chat/completions",
            b"{\n  \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}],\n  \"max_tokens\": 2\n}\n",
        ),
    ];
    for (path, body) in bodies {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json\r\n\
             X-Data-Parallel-Rank: 3\r\nx-override-routed-dp-rank: 3\r\ncontent-length: {}",
            body.len()
        );
        let reply = raw_exchange(world.envoy.listener, &head, &[body], Duration::ZERO);
        assert_eq!(reply.status, 200, "{path}: {reply:?}");
        let recorded = world.sim_of(&reply).last_request();
        assert_eq!(recorded.body, body, "{path}: the body is forwarded byte for byte");
        assert_eq!(
            recorded.header("content-length"),
            Some(body.len().to_string().as_str())
        );
        assert_pinned(&recorded, path);
        assert_eq!(recorded.rank, Some(reply.rank() as u64));
    }

    // A long prompt (about 3,000 tokens), then the same prompt with another
    // question: every one lands on the engine that cached it first, and
    // vLLM reports the cached tokens.
    let document = "The ranks of a data-parallel server each keep a cache of prefixes. ".repeat(250);
    let ask = |question: &str| -> Reply {
        let body = serde_json::json!({
            "model": "sim-model",
            "messages": [
                {"role": "system", "content": document},
                {"role": "user", "content": question},
            ],
            "max_tokens": 4,
        });
        let reply = world.post("/v1/chat/completions", &body.to_string());
        assert_eq!(reply.status, 200, "{reply:?}");
        reply
    };
    let first = ask("What is cached?");
    let home = world.served_by(&first);
    for question in ["Where?", "For how long?", "By whom?"] {
        let reply = ask(question);
        assert_eq!(world.served_by(&reply), home, "{question}");
        let cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(cached >= 2_000, "{question}: {cached} cached tokens");
        assert_pinned(&world.sim_of(&reply).last_request(), question);
    }
    let stats = world.envoy.stats();
    assert!(
        !stats
            .keys()
            .any(|k| k.starts_with("passthrough.") || k.starts_with("rejected.")),
        "{stats:?}"
    );
}

/// Each hostile `/metrics` answer of worker_b fails or refuses its polls;
/// worker_a's polls keep succeeding, and every request is answered. Once
/// worker_b's snapshot is stale, dprank routes around it; once it answers
/// well again, it is polled and routed to again.
#[test]
fn vllm_hostile_metrics_cost_only_that_worker_its_freshness() {
    let world = start(&[]);
    let a_ok = || world.envoy.stat("poll_ok.worker_a");
    let b_bad = || world.envoy.stat("poll_failed.worker_b") + world.envoy.stat("report_refused.worker_b");
    let worker_b = world.sim("worker_b");
    for fault in [
        "malformed",
        "truncated",
        "nan",
        "wrong_labels",
        "huge",
        "http_500",
    ] {
        let (a_before, b_before) = (a_ok(), b_bad());
        worker_b.control(serde_json::json!({ "load_fault": fault }));
        wait_until(
            &format!("{fault}: a bad poll of worker_b"),
            Duration::from_secs(15),
            || (b_bad() > b_before).then_some(()),
        );
        wait_until(
            &format!("{fault}: worker_a still polled"),
            Duration::from_secs(15),
            || (a_ok() > a_before).then_some(()),
        );
        let reply = world.post(
            "/v1/completions",
            r#"{"model":"sim-model","prompt":"hello","max_tokens":2}"#,
        );
        assert_eq!(reply.status, 200, "{fault}: {reply:?}");
    }
    // worker_b has answered nothing usable for longer than the stale limit.
    let routed_b = || {
        world
            .envoy
            .stats()
            .iter()
            .filter(|(k, _)| k.starts_with("routed.worker_b."))
            .map(|(_, v)| *v)
            .sum::<u64>()
    };
    std::thread::sleep(Duration::from_millis(1_500));
    let before = routed_b();
    for i in 0..6 {
        let body = format!(r#"{{"model":"sim-model","prompt":"stale {i}","max_tokens":2}}"#);
        let reply = world.post("/v1/completions", &body);
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(
            world.sim_of(&reply).name,
            "worker_a",
            "request {i}: worker_b is stale"
        );
    }
    assert_eq!(routed_b(), before);

    worker_b.control(serde_json::json!({ "load_fault": "none" }));
    let ok_before = world.envoy.stat("poll_ok.worker_b");
    world
        .envoy
        .wait_for_stat("poll_ok.worker_b", ok_before + 1, Duration::from_secs(15));
    let served: Vec<String> = (0..12)
        .map(|i| {
            let body = format!(r#"{{"model":"sim-model","prompt":"back {i}","max_tokens":2}}"#);
            let reply = world.post("/v1/completions", &body);
            assert_eq!(reply.status, 200, "{reply:?}");
            world.sim_of(&reply).name.clone()
        })
        .collect();
    assert!(
        served.iter().any(|w| w == "worker_b"),
        "worker_b back in use: {served:?}"
    );
}

/// vLLM 0.12 and 0.13 parse the header and drop it: every request is still
/// answered, on the engine vLLM's own balancer picks (docs/rank-headers.md).
#[test]
fn vllm_a_server_that_ignores_the_header_still_answers() {
    let world = start(&["--rank-header", "ignore"]);
    let mut differs = 0;
    for i in 0..16 {
        let body = format!(r#"{{"model":"sim-model","prompt":"ignored {i}","max_tokens":2}}"#);
        let reply = world.post("/v1/completions", &body);
        assert_eq!(reply.status, 200, "{reply:?}");
        let recorded = world.sim_of(&reply).last_request();
        let header: Option<u64> = recorded
            .header("x-data-parallel-rank")
            .and_then(|r| r.parse().ok());
        assert!(header.is_some(), "dprank still names an engine");
        if header != recorded.rank {
            differs += 1;
        }
    }
    assert!(differs > 0, "the server's balancer, not the header, chose");
}

/// worker_a dies while its snapshot is still fresh: the requests dprank
/// routes there are retried by Envoy on worker_b with the same
/// `x-data-parallel-rank`, and served on that engine; passive health
/// then takes worker_a out of rotation.
#[test]
fn vllm_retries_land_on_the_alternate_with_the_same_engine() {
    let mut world = start(&[]);
    world.sims[0].kill();
    let mut served = Vec::new();
    for i in 0..20 {
        let body = format!(r#"{{"model":"sim-model","prompt":"a down {i}","max_tokens":2}}"#);
        let reply = world.post("/v1/completions", &body);
        assert_eq!(reply.status, 200, "{i}: {reply:?}");
        let worker = world.sim_of(&reply);
        assert_eq!(worker.name, "worker_b", "{i}");
        let recorded = worker.last_request();
        assert_pinned(&recorded, &format!("request {i}"));
        served.push(reply.rank());
    }
    let routed_to_dead: u64 = world
        .envoy
        .stats()
        .iter()
        .filter(|(k, _)| k.starts_with("routed.worker_a."))
        .map(|(_, v)| *v)
        .sum();
    let retried = world.envoy.stat("retry.to_alternate");
    eprintln!(
        "vllm retries: {routed_to_dead} routed to the dead worker_a, {retried} retried; engines {served:?}"
    );
    assert!(
        routed_to_dead >= 1,
        "dprank never chose worker_a while it was fresh"
    );
    assert_eq!(retried, routed_to_dead, "every one retried on the alternate");
    assert_eq!(
        world.envoy.stat("ejections.worker_a"),
        1,
        "passive health ejected it"
    );
}
