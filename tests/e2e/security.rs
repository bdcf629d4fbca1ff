//! What a client must not be able to do through the filter (docs/requests.md,
//! "Security"), beyond `input.rs`: reach a host outside the pool, pick a rank
//! when the filter has no data to route with, keep the pin header when it is
//! configured; and the filter calling anything but its configured clusters.

use crate::common::http::{raw_exchange, raw_exchange_bytes};
use crate::common::raw::h2_exchange;
use crate::common::{EnvoyOptions, Reply, Sim, TestDir, World};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;

/// worker_a rank 1 is the clear minimum.
fn loads() -> Vec<Value> {
    World::base_tokens(&[&[5000, 1000, 5000, 7000], &[6000, 6000, 6000, 2000]])
}

/// Asserts a simulator outside the pool saw nothing at all.
fn assert_untouched_outsider(outsider: &Sim, what: &str) {
    let requests = outsider.requests();
    assert!(requests.is_empty(), "{what}: the outsider received {requests:?}");
    let counters = outsider.counters();
    assert_eq!(
        counters["load_requests"],
        json!({"/get_load": 0, "/v1/loads": 0}),
        "{what}: the outsider was polled"
    );
}

/// `cluster.<name>.<stat>` of every cluster, by cluster name.
/// The worker the filter chose: the first host of its route header (the
/// rest are alternates for Envoy's retries).
fn first_listed(route: Option<&str>) -> Option<String> {
    route.and_then(|r| r.split(',').next()).map(str::to_string)
}

/// Every host the route header lists is a worker of the pool.
fn assert_pool_only(world: &World, route: Option<&str>) {
    for host in route.unwrap_or_default().split(',') {
        assert!(
            world.sims.iter().any(|s| s.addr.to_string() == host),
            "{host} in the route header is none of the workers"
        );
    }
}

fn cluster_stat(world: &World, stat: &str) -> Vec<(String, u64)> {
    let reply = world
        .envoy
        .admin_get(&format!("/stats?format=json&filter=^cluster\\.[^.]+\\.{stat}$"));
    assert_eq!(reply.status, 200, "{reply:?}");
    let mut out: Vec<(String, u64)> = reply.json()["stats"]
        .as_array()
        .map(|stats| {
            stats
                .iter()
                .filter_map(|s| {
                    let name = s["name"].as_str()?;
                    let cluster = name.strip_prefix("cluster.")?.strip_suffix(&format!(".{stat}"))?;
                    Some((cluster.to_string(), s["value"].as_u64()?))
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// Host addresses Envoy holds for a cluster (ORIGINAL_DST adds one per destination used).
fn cluster_hosts(world: &World, cluster: &str) -> BTreeSet<String> {
    let clusters = world.envoy.admin_get("/clusters?format=json").json();
    clusters["cluster_statuses"]
        .as_array()
        .and_then(|all| all.iter().find(|c| c["name"] == cluster))
        .and_then(|c| c["host_statuses"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .map(|h| {
            let socket = &h["address"]["socket_address"];
            format!(
                "{}:{}",
                socket["address"].as_str().unwrap_or("?"),
                socket["port_value"]
            )
        })
        .collect()
}

#[test]
fn no_client_reaches_a_host_outside_the_pool() {
    let world = World::start("security", 2, &["--instant"], &loads(), EnvoyOptions::default());
    let dir = TestDir::new("security_outsider");
    let outsider = Sim::start(&dir, "outsider", 4, &["--instant"]);
    let out = outsider.addr.to_string();
    let pool: BTreeSet<String> = world.sims.iter().map(|s| s.addr.to_string()).collect();
    let steer: [(&str, &str); 3] = [
        ("x-dprank-endpoint", &out),
        ("x-envoy-original-dst-host", &out),
        ("host", &out),
    ];
    let answered_by_pool = |reply: &Reply, what: &str| {
        let worker = reply
            .header("x-sim-worker")
            .unwrap_or_else(|| panic!("{what}: not answered by a worker: {reply:?}"));
        assert!(pool.contains(worker), "{what}: answered by {worker}");
    };

    // Routed, passed through (not JSON, unrouted path, GET), each with every steering header.
    let json_headers: Vec<(&str, &str)> = [("content-type", "application/json")]
        .into_iter()
        .chain(steer)
        .collect();
    let url = |path: &str| world.envoy.url(path);
    let reply = world
        .client
        .post(&url("/generate"), &json_headers, br#"{"text":"steer"}"#);
    assert_eq!(
        world.served_by(&reply),
        ("worker_a".to_string(), 1),
        "routed as usual"
    );
    let recorded = world.sim("worker_a").last_request();
    assert_eq!(
        first_listed(recorded.header("x-dprank-endpoint")),
        Some(world.sim("worker_a").addr.to_string()),
        "only the filter's own route header goes upstream"
    );
    assert_pool_only(&world, recorded.header("x-dprank-endpoint"));
    for _ in 0..4 {
        let reply = world.client.post(&url("/generate"), &json_headers, b"not json");
        answered_by_pool(&reply, "not JSON");
        assert_eq!(
            world.sim_of(&reply).last_request().header("x-dprank-endpoint"),
            None
        );
    }
    let reply = world
        .client
        .post(&url("/v1/embeddings"), &json_headers, br#"{"input":"x"}"#);
    answered_by_pool(&reply, "unrouted path");
    let reply = world.client.get(&url("/v1/models"), &steer);
    assert_eq!(reply.status, 200, "{reply:?}");
    answered_by_pool(&reply, "GET");

    // HTTP/2 with the outsider as :authority.
    let reply = h2_exchange(
        world.envoy.listener,
        "POST",
        "/generate",
        &[
            ("content-type", "application/json"),
            ("x-dprank-endpoint", &out),
            ("x-envoy-original-dst-host", &out),
        ],
        &[br#"{"text":"h2 steer"}"#],
        &[],
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    answered_by_pool(&reply, "HTTP/2");

    // Absolute-form request target naming the outsider, and a CONNECT to it.
    let body = br#"{"text":"absolute"}"#;
    let head = format!(
        "POST http://{out}/generate HTTP/1.1\r\nhost: {out}\r\ncontent-type: application/json\r\n\
         x-envoy-original-dst-host: {out}\r\ncontent-length: {}",
        body.len()
    );
    let reply = raw_exchange(world.envoy.listener, &head, &[body], Duration::ZERO);
    assert_eq!(reply.status, 200, "{reply:?}");
    answered_by_pool(&reply, "absolute-form target");
    let reply = raw_exchange(
        world.envoy.listener,
        &format!("CONNECT {out} HTTP/1.1\r\nhost: {out}"),
        &[],
        Duration::ZERO,
    );
    assert!(
        reply.status >= 400 && reply.header("x-sim-worker").is_none(),
        "CONNECT is refused by Envoy: {reply:?}"
    );

    // A header given twice is removed entirely, on routed and passed-through requests.
    for (body, routed) in [
        (&br#"{"text":"twice"}"#[..], true),
        (&b"not json twice"[..], false),
    ] {
        let b_addr = world.sim("worker_b").addr.to_string();
        let head = format!(
            "POST /generate HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json\r\n\
             X-Dprank-Endpoint: {b_addr}\r\nx-dprank-endpoint: {out}\r\ncontent-length: {}",
            body.len()
        );
        let reply = raw_exchange(world.envoy.listener, &head, &[body], Duration::ZERO);
        answered_by_pool(&reply, "header twice");
        let sim = world.sim_of(&reply);
        let seen = sim.last_request().header("x-dprank-endpoint").map(str::to_string);
        if routed {
            assert_eq!(world.served_by(&reply), ("worker_a".to_string(), 1));
            assert_eq!(
                first_listed(seen.as_deref()),
                Some(sim.addr.to_string()),
                "the filter's value alone"
            );
            assert_pool_only(&world, seen.as_deref());
        } else {
            assert_eq!(seen, None, "not routed: no route header at all");
        }
    }

    assert_untouched_outsider(&outsider, "steering headers");

    // The filter's own calls: polls through dprank_poll to the pool only;
    // client traffic through sglang. No other cluster sees a request.
    let requests = cluster_stat(&world, "upstream_rq_total");
    for (cluster, count) in &requests {
        match cluster.as_str() {
            "sglang" | "dprank_poll" => assert!(*count > 0, "{cluster}: {requests:?}"),
            _ => assert_eq!(*count, 0, "cluster {cluster} saw requests: {requests:?}"),
        }
    }
    let connections = cluster_stat(&world, "upstream_cx_total");
    assert!(
        connections
            .iter()
            .all(|(c, n)| *n == 0 || c == "sglang" || c == "dprank_poll"),
        "{connections:?}"
    );
    assert_eq!(
        cluster_hosts(&world, "dprank_poll"),
        pool,
        "polls go to the pool only"
    );
    assert_eq!(cluster_hosts(&world, "sglang"), pool);
    eprintln!("security: upstream requests per cluster {requests:?}");
}

#[test]
fn without_data_client_ranks_are_nulled_and_the_pin_header_is_stripped() {
    // Every poll fails from the start: nothing to route with.
    let world = World::start_with_failing_polls("security_pin");
    let pin = [
        ("content-type", "application/json"),
        ("x-dprank-pin", "worker_b/3"),
    ];

    // Both rank names (and any duplicate) are nulled: the server decides.
    let body = r#"{"routed_dp_rank":3,"text":"mine","data_parallel_rank": 3,"routed_dp_rank":2}"#;
    let mut ranks = BTreeSet::new();
    for _ in 0..4 {
        let reply = world
            .client
            .post(&world.envoy.url("/generate"), &pin, body.as_bytes());
        assert_eq!(reply.status, 200, "{reply:?}");
        let recorded = world.sim_of(&reply).last_request();
        assert_eq!(
            recorded.body_text(),
            r#"{"routed_dp_rank":null,"text":"mine","data_parallel_rank": null,"routed_dp_rank":null}"#
        );
        assert_eq!(recorded.header("x-dprank-pin"), None, "pin header stripped");
        ranks.insert(reply.rank());
    }
    assert!(ranks.len() > 1, "the workers' own round robin picks: {ranks:?}");
    assert!(world.envoy.stat("passthrough.no_fresh_data") >= 4);
    assert_eq!(
        world.envoy.stat("pin_ignored"),
        4,
        "a pin naming no fresh rank is ignored"
    );

    // PD names are not rank fields in regular mode: left as sent.
    let body = r#"{"text":"pd names","decode_dp_rank":3,"disagg_prefill_dp_rank":3}"#;
    let reply = world.post("/generate", body);
    assert_eq!(world.sim_of(&reply).last_request().body_text(), body);

    // The pin header is stripped from what the filter does not route, too
    // (this scenario routes /generate only).
    let replies = [
        world.client.post(
            &world.envoy.url("/v1/completions"),
            &pin,
            br#"{"prompt":"x","max_tokens":1}"#,
        ),
        world
            .client
            .post(&world.envoy.url("/generate"), &pin, b"not json"),
    ];
    for reply in &replies {
        let recorded = world.sim_of(reply).last_request();
        assert_eq!(recorded.header("x-dprank-pin"), None, "{reply:?}");
    }
    assert_eq!(world.envoy.stat("passthrough.path"), 1);
    assert_eq!(
        world.envoy.stat("pin_ignored"),
        4,
        "only routable requests consult the pin"
    );
}

/// Bodies serde_json refuses but Python's `json.loads` (which SGLang's
/// FastAPI server parses requests with) accepts, each carrying a client rank.
fn python_only_bodies() -> Vec<(&'static str, Vec<u8>)> {
    let plain = r#"{"text":"x","routed_dp_rank":3}"#;
    let mut bom = b"\xef\xbb\xbf".to_vec();
    bom.extend_from_slice(plain.as_bytes());
    let mut utf16 = vec![0xff, 0xfe];
    utf16.extend(plain.encode_utf16().flat_map(u16::to_le_bytes));
    vec![
        ("UTF-8 BOM", bom),
        (
            "NaN",
            br#"{"text":"x","routed_dp_rank":3,"temperature":NaN}"#.to_vec(),
        ),
        (
            "Infinity",
            br#"{"text":"x","routed_dp_rank":3,"top_p":Infinity}"#.to_vec(),
        ),
        ("UTF-16", utf16),
    ]
}

/// A body dprank cannot read that names a rank is refused in every mode:
/// passed on untouched, a Python server would honour the client's rank.
#[test]
fn a_client_rank_in_a_body_only_python_parses_is_not_passed_on() {
    let world = World::start("security", 2, &["--instant"], &loads(), EnvoyOptions::default());
    for (what, body) in python_only_bodies() {
        let reply = world.client.post(
            &world.envoy.url("/generate"),
            &[("content-type", "application/json")],
            &body,
        );
        assert_eq!(reply.status, 400, "{what}: {reply:?}");
        assert!(
            reply.header("x-sim-worker").is_none(),
            "{what}: answered by the filter"
        );
        assert!(reply.json()["error"]["message"].is_string(), "{what}: {reply:?}");
    }
    for sim in &world.sims {
        assert!(
            sim.requests().is_empty(),
            "{} received a body with a client rank",
            sim.name
        );
    }
    assert_eq!(world.envoy.stat("rejected.unreadable_rank"), 4);
}

/// Rank and bootstrap headers SGLang and vLLM read (docs/rank-headers.md), as
/// a client might send them: mixed case, one given twice.
const CLIENT_RANK_HEADERS: [(&str, &str); 7] = [
    ("X-Data-Parallel-Rank", "3"),
    ("x-data-parallel-rank", "2"),
    ("X-Override-Routed-Dp-Rank", "3"),
    ("x-override-disagg-prefill-dp-rank", "3"),
    ("X-OVERRIDE-BOOTSTRAP-HOST", "10.9.9.9"),
    ("x-override-bootstrap-port", "1"),
    ("x-override-bootstrap-room", "7"),
];

/// Asserts a recorded request carries none of the client rank headers.
fn assert_no_client_rank_header(recorded: &crate::common::sim::Recorded, what: &str) {
    for (name, _) in CLIENT_RANK_HEADERS {
        assert_eq!(
            recorded.header(&name.to_ascii_lowercase()),
            None,
            "{what}: {name} reached the worker"
        );
    }
}

/// Body mode: a client cannot pick its rank (or its PD bootstrap) through
/// the headers servers read, on routed requests and on those the filter
/// passes through, over HTTP/1.1 in any casing and over HTTP/2.
#[test]
fn client_rank_and_bootstrap_headers_never_reach_a_worker() {
    let world = World::start("security", 2, &["--instant"], &loads(), EnvoyOptions::default());
    let cases: [(&str, &[u8], &str, bool); 4] = [
        ("/generate", br#"{"text":"routed"}"#, "", true),
        (
            "/v1/chat/completions",
            br#"{"messages":[{"role":"user","content":"hi"}]}"#,
            "",
            true,
        ),
        ("/generate", b"not json", "", false),
        ("/generate", b"\x1f\x8b", "content-encoding: gzip\r\n", false),
    ];
    for (path, body, extra, routed) in cases {
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n",
            body.len()
        );
        for (name, value) in CLIENT_RANK_HEADERS {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        let reply = raw_exchange(world.envoy.listener, &head, &[body], Duration::ZERO);
        let what = format!("{path} {:?}", String::from_utf8_lossy(body));
        let recorded = world.sim_of(&reply).last_request();
        assert_no_client_rank_header(&recorded, &what);
        if routed {
            assert_eq!(world.served_by(&reply), ("worker_a".to_string(), 1), "{what}");
        }
    }
    let mut headers = vec![("content-type", "application/json")];
    let lowercase: Vec<(String, &str)> = CLIENT_RANK_HEADERS
        .iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), *v))
        .collect();
    headers.extend(lowercase.iter().map(|(k, v)| (k.as_str(), *v)));
    let reply = h2_exchange(
        world.envoy.listener,
        "POST",
        "/generate",
        &headers,
        &[br#"{"text":"h2"}"#],
        &[],
    );
    assert_eq!(world.served_by(&reply), ("worker_a".to_string(), 1));
    assert_no_client_rank_header(&world.sim_of(&reply).last_request(), "HTTP/2");
    assert_eq!(world.envoy.stat("passthrough.not_json"), 1);
    assert_eq!(world.envoy.stat("passthrough.content_encoding"), 1);
}

/// A header value that is not UTF-8 (HTTP/1.1 allows such bytes) in a
/// header the filter reads is handled like any other value, never a panic.
#[test]
fn header_values_that_are_not_utf8_are_routed_or_passed_like_others() {
    let world = World::start("security", 2, &["--instant"], &loads(), EnvoyOptions::default());
    let body = br#"{"text":"latin-1"}"#;
    for (extra, routed) in [
        (&b"x-note: caf\xe9\r\n"[..], true),
        (&b"content-encoding: caf\xe9\r\n"[..], false),
        (&b"x-data-parallel-rank: \xff\r\n"[..], true),
    ] {
        let mut head = format!(
            "POST /generate HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
            body.len()
        )
        .into_bytes();
        head.extend_from_slice(extra);
        let reply = raw_exchange_bytes(world.envoy.listener, &head, &[body], Duration::ZERO);
        let what = String::from_utf8_lossy(extra).into_owned();
        assert!(reply.header("x-sim-worker").is_some(), "{what}: {reply:?}");
        assert_eq!(
            world
                .sim_of(&reply)
                .last_request()
                .header("x-dprank-endpoint")
                .is_some(),
            routed,
            "{what}"
        );
        assert_no_client_rank_header(&world.sim_of(&reply).last_request(), &what);
    }
}
