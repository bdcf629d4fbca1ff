//! Header mode (`rank_transport: header`, scenario `header_mode`): the rank
//! reaches the worker in headers, the body is never buffered or changed, the
//! OpenAI Python client works streamed and not, client rank headers never
//! reach a worker, and bodies beyond the listener's buffer limit are routed.

use crate::common::http::{chunked, raw_exchange, raw_exchange_bytes};
use crate::common::raw::h2_exchange;
use crate::common::{repo_root, wait_until, EnvoyOptions, World};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// worker_a rank 1 is the clear minimum.
fn loads() -> Vec<Value> {
    World::base_tokens(&[&[5000, 1000, 5000, 7000], &[6000, 6000, 6000, 2000]])
}

fn start() -> World {
    World::start(
        "header_mode",
        2,
        &["--instant"],
        &loads(),
        EnvoyOptions::default(),
    )
}

/// Rank and bootstrap headers a client might send, mixed case, one twice.
const CLIENT_RANK_HEADERS: [(&str, &str); 7] = [
    ("X-Data-Parallel-Rank", "3"),
    ("x-data-parallel-rank", "2"),
    ("X-Override-Routed-Dp-Rank", "3"),
    ("x-override-disagg-prefill-dp-rank", "3"),
    ("X-Override-Bootstrap-Host", "10.9.9.9"),
    ("x-override-bootstrap-port", "1"),
    ("x-override-bootstrap-room", "7"),
];

/// Asserts the worker saw dprank's rank `rank` in both default rank headers,
/// no client bootstrap header, and the route header naming it first.
fn assert_rank_headers(world: &World, recorded: &crate::common::sim::Recorded, rank: &str, what: &str) {
    assert_eq!(recorded.header("x-data-parallel-rank"), Some(rank), "{what}");
    assert_eq!(recorded.header("x-override-routed-dp-rank"), Some(rank), "{what}");
    for name in [
        "x-override-disagg-prefill-dp-rank",
        "x-override-bootstrap-host",
        "x-override-bootstrap-port",
        "x-override-bootstrap-room",
    ] {
        assert_eq!(recorded.header(name), None, "{what}: {name} reached the worker");
    }
    // worker_b has the rank too: the alternate Envoy would retry on, with
    // the same rank headers.
    let route = format!("{},{}", world.sim("worker_a").addr, world.sim("worker_b").addr);
    assert_eq!(
        recorded.header("x-dprank-endpoint"),
        Some(route.as_str()),
        "{what}"
    );
}

#[test]
fn the_rank_travels_in_headers_and_the_body_arrives_byte_for_byte() {
    let world = start();
    // Whitespace, unicode, escapes, a key order a re-serialising proxy would not keep.
    let bodies: [(&str, &[u8]); 3] = [
        (
            "/generate",
            " \n{ \"text\" :\t\"h\u{e9}llo \\\"w\u{f6}rld\\\" \u{1f680}\" ,\"sampling_params\":{\"max_new_tokens\":1}}\r\n "
                .as_bytes(),
        ),
        (
            "/v1/completions",
            "{\"prompt\":\"\u{65e5}\u{672c}\u{8a9e}\",\"max_tokens\":1,\"b\":[],\"a\":{}}".as_bytes(),
        ),
        (
            "/v1/chat/completions",
            b"{\n  \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}],\n  \"max_tokens\": 1\n}\n",
        ),
    ];
    for (path, body) in bodies {
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
            body.len()
        );
        for (name, value) in CLIENT_RANK_HEADERS {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        let reply = raw_exchange(world.envoy.listener, &head, &[body], Duration::ZERO);
        assert_eq!(reply.status, 200, "{path}: {reply:?}");
        assert_eq!(
            world.served_by(&reply),
            ("worker_a".to_string(), 1),
            "{path}: served on the header's rank"
        );
        let recorded = world.sim_of(&reply).last_request();
        assert_eq!(recorded.body, body, "{path}: the body is forwarded byte for byte");
        assert_eq!(
            recorded.header("content-length"),
            Some(body.len().to_string().as_str())
        );
        assert_rank_headers(&world, &recorded, "1", path);
    }
    // HTTP/2, and a chunked HTTP/1.1 body without content-length.
    let h2_body = br#"{"text":"over h2"}"#;
    let reply = h2_exchange(
        world.envoy.listener,
        "POST",
        "/generate",
        &[
            ("content-type", "application/json"),
            ("x-data-parallel-rank", "0"),
        ],
        &[h2_body],
        &[],
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    let recorded = world.sim_of(&reply).last_request();
    assert_eq!(recorded.body, h2_body);
    assert_rank_headers(&world, &recorded, "1", "HTTP/2");
    let parts: [&[u8]; 2] = [b"{\"text\":", b"\"chunked\"}"];
    let chunks = chunked(&parts);
    let chunk_refs: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
    let reply = raw_exchange(
        world.envoy.listener,
        "POST /generate HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json\r\ntransfer-encoding: chunked",
        &chunk_refs,
        Duration::from_millis(20),
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    let recorded = world.sim_of(&reply).last_request();
    assert_eq!(recorded.body, parts.concat());
    assert_rank_headers(&world, &recorded, "1", "chunked");

    assert_eq!(world.envoy.stat("routed.worker_a.rank_1"), 5);
    // A body rank field is the client's to keep in header mode: the server's
    // header wins over it where the header is honoured (docs/rank-headers.md).
    let stats = world.envoy.stats();
    assert!(
        !stats
            .keys()
            .any(|k| k.starts_with("passthrough.") || k.starts_with("rejected.")),
        "{stats:?}"
    );
}

#[test]
fn client_rank_headers_are_stripped_from_requests_header_mode_does_not_route() {
    let world = start();
    let mut extra = String::new();
    for (name, value) in CLIENT_RANK_HEADERS {
        extra.push_str(&format!("{name}: {value}\r\n"));
    }
    // An unrouted path and an empty body: passed on, without the client's headers.
    for (path, body) in [
        ("/v1/embeddings", &br#"{"input":"x"}"#[..]),
        ("/generate", &b""[..]),
    ] {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json\r\n{extra}content-length: {}",
            body.len()
        );
        let reply = raw_exchange_bytes(world.envoy.listener, head.as_bytes(), &[body], Duration::ZERO);
        assert!(reply.header("x-sim-worker").is_some(), "{path}: {reply:?}");
        if path == "/generate" {
            let recorded = world.sim_of(&reply).last_request();
            for (name, _) in CLIENT_RANK_HEADERS {
                assert_eq!(
                    recorded.header(&name.to_ascii_lowercase()),
                    None,
                    "{path}: {name}"
                );
            }
            assert_eq!(recorded.header("x-dprank-endpoint"), None, "not routed");
        }
    }
    assert_eq!(world.envoy.stat("passthrough.path"), 1);
    assert_eq!(world.envoy.stat("passthrough.empty_body"), 1);
}

/// The Python interpreter with the `openai` package: `DPRANK_PYTHON`, else
/// the project's `.venv` (`scripts/setup.sh` installs the package there).
pub fn python() -> PathBuf {
    std::env::var_os("DPRANK_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/python"))
}

/// Runs the OpenAI Python client (`header_mode/openai_client.py`) against
/// `base_url` and checks what every engine must give it: both streams
/// arrived in at least as many chunks as tokens, with text. Returns its
/// report for the engine's own checks.
pub fn openai_client(base_url: &str) -> Value {
    let script = repo_root().join("tests/e2e/header_mode/openai_client.py");
    let output = Command::new(python())
        .arg(&script)
        .arg(base_url)
        .arg("sim-model")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} with {}: {e}", script.display(), python().display()));
    assert!(
        output.status.success(),
        "openai_client.py failed (is `openai` installed? `make setup`):\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let result: Value = serde_json::from_slice(&output.stdout).expect("openai_client.py prints JSON");
    eprintln!("openai client: {result}");
    for (stream, tokens) in [("chat_stream", 24), ("completion_stream", 16)] {
        let chunks = result[stream]["chunks"].as_u64().unwrap_or(0);
        assert!(
            chunks >= tokens,
            "{stream}: {chunks} chunks for {tokens} tokens: {result}"
        );
        assert!(
            result[stream]["text"].as_str().is_some_and(|t| !t.is_empty()),
            "{stream}"
        );
    }
    result
}

#[test]
fn the_openai_client_works_streamed_and_not() {
    let world = start();
    let result = openai_client(&world.envoy.url("/v1"));
    assert!(
        result["chat"]["text"].as_str().is_some_and(|t| !t.is_empty()),
        "{result}"
    );
    assert_eq!(result["chat"]["completion_tokens"], 8);

    // The worker saw four requests, each with dprank's rank in headers and
    // the client's JSON untouched (no rank field added).
    let recorded: Vec<_> = world.sims.iter().flat_map(|s| s.requests()).collect();
    assert_eq!(recorded.len(), 4, "{recorded:?}");
    for request in &recorded {
        assert_rank_headers(&world, request, "1", &request.path);
        assert_eq!(request.rank, Some(1), "served on the header's rank");
        let body = request.body_json();
        assert!(body.get("routed_dp_rank").is_none() && body.get("data_parallel_rank").is_none());
        assert_eq!(
            request.header("content-length"),
            Some(request.body.len().to_string().as_str())
        );
        assert!(
            request
                .header("user-agent")
                .is_some_and(|ua| ua.contains("OpenAI")),
            "{request:?}"
        );
    }
    assert_eq!(
        recorded
            .iter()
            .filter(|r| r.body_json()["stream"] == true)
            .count(),
        2
    );
}

/// Without buffering, the upstream request starts as soon as the headers are
/// routed, while the client is still sending the body.
#[test]
fn the_upstream_request_starts_before_the_body_is_complete() {
    let world = start();
    let upstream_requests = || {
        world
            .envoy
            .stats_matching("cluster.sglang.upstream_rq_total")
            .get("cluster.sglang.upstream_rq_total")
            .copied()
            .unwrap_or(0)
    };
    let before = upstream_requests();
    let mut stream = TcpStream::connect(world.envoy.listener).expect("connect to Envoy");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let head = "POST /generate HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json\r\n\
                transfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    stream.write_all(head.as_bytes()).expect("write head");
    stream
        .write_all(&chunked(&[b"{\"text\":"])[0])
        .expect("first chunk");
    wait_until("the upstream request to start", Duration::from_secs(10), || {
        (upstream_requests() > before).then_some(())
    });
    for chunk in chunked(&[b"\"late\"}"]) {
        stream.write_all(&chunk).expect("rest of the body");
    }
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert_eq!(world.envoy.stat("routed.worker_a.rank_1"), 1);
}

/// Far beyond the shipped 32 MiB buffer limit (where body mode answers 413):
/// header mode streams it to the worker.
#[test]
fn a_40_mib_body_routes_under_the_shipped_config() {
    let world = start();
    // JSON whitespace, so the worker's prompt stays short.
    let padding = vec![b' '; 40 << 20];
    let open = b"{\"text\":\"long\",";
    let close = b"\"sampling_params\":{\"max_new_tokens\":1}}";
    let head = format!(
        "POST /generate HTTP/1.1\r\nhost: dprank\r\ncontent-type: application/json\r\ncontent-length: {}",
        open.len() + padding.len() + close.len()
    );
    let reply = raw_exchange(
        world.envoy.listener,
        &head,
        &[open, &padding, close],
        Duration::ZERO,
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(world.sim_of(&reply).name, "worker_a");
    assert_eq!(world.envoy.stat("routed.worker_a.rank_1"), 1);
}

/// Where the server does not read the header, the request is still answered,
/// on a rank the server picks (docs/rank-headers.md): SGLang releases up to
/// 0.5.23 (`--rank-header openai`) ignore `x-data-parallel-rank` on
/// `/generate`, and honour `x-override-routed-dp-rank` there only with
/// request-header overrides enabled.
#[test]
fn the_rank_is_pinned_only_where_the_server_reads_the_header() {
    let served = |world: &World, path: &str, body: &str| -> Vec<i64> {
        (0..4)
            .map(|_| {
                let reply = world.post(path, body);
                assert_eq!(reply.status, 200, "{path}: {reply:?}");
                assert_eq!(
                    world.sim_of(&reply).name,
                    "worker_a",
                    "dprank still picks the worker"
                );
                reply.rank()
            })
            .collect()
    };
    let chat = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
    let generate = r#"{"text":"hi","sampling_params":{"max_new_tokens":1}}"#;

    let world = World::start(
        "header_mode",
        2,
        &["--instant", "--rank-header", "openai"],
        &loads(),
        EnvoyOptions::default(),
    );
    assert_eq!(served(&world, "/v1/chat/completions", chat), [1; 4]);
    let ignored = served(&world, "/generate", generate);
    assert!(
        ignored.iter().any(|r| *r != 1),
        "/generate ignores the header: the server's round robin picks {ignored:?}"
    );
    assert_eq!(
        world.envoy.stat("routed.worker_a.rank_1"),
        8,
        "dprank cannot tell"
    );
    drop(world);

    let world = World::start(
        "header_mode",
        2,
        &["--instant", "--rank-header", "openai", "--header-overrides"],
        &loads(),
        EnvoyOptions::default(),
    );
    assert_eq!(
        served(&world, "/generate", generate),
        [1; 4],
        "x-override-routed-dp-rank"
    );
    assert_eq!(served(&world, "/v1/chat/completions", chat), [1; 4]);
}
