//! Deployment layouts (sim/README.md, "Deployment layouts") at the HTTP
//! level and in virtual time: vLLM hybrid and external load balancing
//! (`--dp-start-rank`, global `engine` labels) with the Python and the Rust
//! frontend's reading of `X-data-parallel-rank`, and SGLang's one port per
//! rank (`--rank-ports`) with its load reports.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{client, fast_config};
use dprank_sim::offline::{Fleet, Prompt, Request};
use dprank_sim::server::WorkerAddrs;
use dprank_sim::{CostPreset, EngineKind, RankPortLoads, SimConfig, SimServer, VllmFrontend, VllmVersion};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// A dense vLLM server of `engines` engines whose first is global rank
/// `start`, fast.
fn vllm(engines: usize, start: usize, frontend: VllmFrontend) -> SimConfig {
    SimConfig {
        engine: EngineKind::Vllm,
        cost_model: CostPreset::Dense8b,
        dp_size: Some(engines),
        dp_start_rank: vec![start],
        vllm_frontend: frontend,
        tokenizer_delay_us: 0.0,
        tokenizer_us_per_token: 0.0,
        time_scale: 50.0,
        ..SimConfig::default()
    }
}

/// SGLang, one port per rank.
fn rank_ports(loads: RankPortLoads, start: usize) -> SimConfig {
    SimConfig {
        rank_ports: true,
        rank_port_loads: loads,
        dp_start_rank: vec![start],
        ..fast_config()
    }
}

async fn start_one(config: SimConfig, loads_port: bool) -> SimServer {
    let addrs = WorkerAddrs {
        loads: loads_port.then(|| "127.0.0.1:0".parse().unwrap()),
        ..WorkerAddrs::new("127.0.0.1:0".parse().unwrap())
    };
    SimServer::start_workers(Arc::new(config), &[addrs])
        .await
        .unwrap()
        .pop()
        .unwrap()
}

struct Reply {
    status: StatusCode,
    rank: i64,
    text: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|err| panic!("not JSON ({err}): {}", self.text))
    }
}

async fn send(url: &str, path: &str, body: &str, rank_header: Option<&str>) -> Reply {
    let mut request = client()
        .post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .timeout(Duration::from_secs(30));
    if let Some(value) = rank_header {
        request = request.header("X-data-parallel-rank", value);
    }
    let response = request.send().await.unwrap();
    let status = response.status();
    let rank = response.headers()["x-sim-dp-rank"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    Reply {
        status,
        rank,
        text: response.text().await.unwrap(),
    }
}

async fn fetch(url: &str, path: &str) -> (StatusCode, String) {
    let response = client()
        .get(format!("{url}{path}"))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    (response.status(), response.text().await.unwrap())
}

const COMPLETION: &str = r#"{"prompt":"hello there","max_tokens":2}"#;
const STREAMED: &str = r#"{"prompt":"hello there","max_tokens":2,"stream":true}"#;

/// The `engine` labels of `vllm:num_requests_running`, in order.
fn running_labels(metrics: &str) -> Vec<String> {
    metrics
        .lines()
        .filter(|line| line.starts_with("vllm:num_requests_running{"))
        .map(|line| {
            let start = line.find("engine=\"").unwrap() + 8;
            let end = start + line[start..].find('"').unwrap();
            line[start..end].to_string()
        })
        .collect()
}

#[tokio::test]
async fn a_hybrid_node_labels_its_engines_with_their_global_ranks_everywhere() {
    let server = common::start(vllm(4, 4, VllmFrontend::Python)).await;
    let (status, metrics) = fetch(&server.url(), "/metrics").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(running_labels(&metrics), ["4", "5", "6", "7"]);
    assert!(!metrics.contains("engine=\"0\""), "{metrics}");
    // Every series carries the global label, cache_config_info too.
    assert!(metrics.contains("vllm:cache_config_info{") && metrics.contains("engine=\"7\""));
    let served = send(&server.url(), "/v1/completions", COMPLETION, Some("1")).await;
    assert_eq!((served.status, served.rank), (StatusCode::OK, 5));
    let records = common::get_json(&server, "/_sim/requests").await;
    assert_eq!(records[0]["rank"], 5);
    // Counters stay per local engine.
    let counters = common::get_json(&server, "/_sim/counters").await;
    assert_eq!(counters["served_per_rank"], json!([0, 1, 0, 0]));
    assert!(server
        .ready_line()
        .starts_with(&format!("ready {} role=regular dp_size=4", server.addr)));
    assert!(server
        .ready_line()
        .ends_with(" engine=vllm-0.14.0 dp_start_rank=4"));
}

#[tokio::test]
async fn the_python_frontend_reads_a_local_index_and_refuses_the_rest_with_vllm_s_400() {
    let server = common::start(vllm(4, 4, VllmFrontend::Python)).await;
    let url = server.url();
    for (value, served) in [("0", 4), (" 3 ", 7), ("+2", 6), ("1_0", -2)] {
        let reply = send(&url, "/v1/completions", COMPLETION, Some(value)).await;
        if served >= 0 {
            assert_eq!((reply.status, reply.rank), (StatusCode::OK, served), "{value:?}");
        } else {
            // 10 is out of range.
            assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{value:?}");
        }
    }
    // A global rank of this very node is out of the local range.
    for (value, rank) in [("4", "4"), ("7", "7"), ("-1", "-1")] {
        let reply = send(&url, "/v1/chat/completions", r#"{"messages":[]}"#, Some(value)).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            reply.json(),
            json!({"error": {"message": format!("data_parallel_rank {rank} is out of range [0, 4)."),
                             "type": "BadRequestError", "param": null, "code": 400}})
        );
    }
    // Not an integer: no rank, vLLM's balancer picks one of this node's.
    let reply = send(&url, "/v1/completions", COMPLETION, Some("five")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!((4..8).contains(&reply.rank), "{}", reply.rank);
}

#[tokio::test]
async fn vllm_0_34_s_python_frontend_refuses_a_streamed_local_overflow_inside_the_stream() {
    let config = SimConfig {
        vllm_version: VllmVersion::V0_34,
        ..vllm(4, 4, VllmFrontend::Python)
    };
    let server = common::start(config).await;
    let reply = send(&server.url(), "/v1/completions", STREAMED, Some("5")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(
        reply
            .text
            .contains(r#""message":"data_parallel_rank 5 is out of range [0, 4).""#),
        "{}",
        reply.text
    );
    assert!(reply.text.ends_with("data: [DONE]\n\n"), "{}", reply.text);
}

#[tokio::test]
async fn the_rust_frontend_reads_a_global_rank_and_refuses_another_node_s_with_its_own_400() {
    let server = common::start(vllm(4, 4, VllmFrontend::Rust)).await;
    let url = server.url();
    for (value, served) in [("4", 4), ("7", 7), (" 5 ", 5), ("+6", 6)] {
        let reply = send(&url, "/v1/completions", COMPLETION, Some(value)).await;
        assert_eq!((reply.status, reply.rank), (StatusCode::OK, served), "{value:?}");
    }
    // Another node's rank, or past the group: 400, streamed or not, before
    // any streaming (whatever the release).
    for (value, body) in [("1", COMPLETION), ("8", STREAMED), ("4294967295", COMPLETION)] {
        let reply = send(&url, "/v1/completions", body, Some(value)).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{value}");
        assert_eq!(
            reply.json(),
            json!({"error": {"message": format!("data parallel rank {value} is out of range for 4 engine(s)"),
                             "type": "invalid_request_error", "param": null,
                             "code": "invalid_request_error"}})
        );
    }
    // Not a u32 (a negative, Python's underscores, beyond u32): no rank.
    for value in ["-1", "1_0", "4294967296", "5.0", "x"] {
        let reply = send(&url, "/v1/completions", COMPLETION, Some(value)).await;
        assert_eq!(reply.status, StatusCode::OK, "{value:?}");
        assert!((4..8).contains(&reply.rank), "{value:?}: {}", reply.rank);
    }
    assert!(server.ready_line().ends_with(" dp_start_rank=4 frontend=rust"));
}

#[tokio::test]
async fn an_external_lb_server_is_one_engine_labelled_with_its_rank() {
    let python = common::start(vllm(1, 3, VllmFrontend::Python)).await;
    let (_, metrics) = fetch(&python.url(), "/metrics").await;
    assert_eq!(running_labels(&metrics), ["3"]);
    assert_eq!(
        send(&python.url(), "/v1/completions", COMPLETION, Some("0"))
            .await
            .rank,
        3
    );
    let refused = send(&python.url(), "/v1/completions", COMPLETION, Some("3")).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        refused.json()["error"]["message"],
        "data_parallel_rank 3 is out of range [0, 1)."
    );
    let rust = common::start(vllm(1, 3, VllmFrontend::Rust)).await;
    assert_eq!(
        send(&rust.url(), "/v1/completions", COMPLETION, Some("3"))
            .await
            .rank,
        3
    );
    let refused = send(&rust.url(), "/v1/completions", COMPLETION, Some("0")).await;
    assert_eq!(
        refused.json()["error"]["message"],
        "data parallel rank 0 is out of range for 1 engine(s)"
    );
}

#[tokio::test]
async fn one_process_serves_a_two_node_hybrid_group_with_one_start_rank_per_worker() {
    let config = SimConfig {
        dp_start_rank: vec![0, 4],
        ..vllm(4, 0, VllmFrontend::Rust)
    };
    let addrs: Vec<WorkerAddrs> = (0..2)
        .map(|_| WorkerAddrs::new("127.0.0.1:0".parse().unwrap()))
        .collect();
    let servers = SimServer::start_workers(Arc::new(config.clone()), &addrs)
        .await
        .unwrap();
    let (_, first) = fetch(&servers[0].url(), "/metrics").await;
    let (_, second) = fetch(&servers[1].url(), "/metrics").await;
    assert_eq!(running_labels(&first), ["0", "1", "2", "3"]);
    assert_eq!(running_labels(&second), ["4", "5", "6", "7"]);
    assert_eq!(
        send(&servers[1].url(), "/v1/completions", COMPLETION, Some("6"))
            .await
            .rank,
        6
    );
    assert_eq!(
        send(&servers[0].url(), "/v1/completions", COMPLETION, Some("6"))
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    assert!(!servers[0].ready_line().contains("dp_start_rank"));
    // Three start ranks for two workers is a mistake.
    let three = SimConfig {
        dp_start_rank: vec![0, 4, 8],
        ..config
    };
    assert!(SimServer::start_workers(Arc::new(three), &addrs).await.is_err());
}

#[tokio::test]
async fn each_rank_port_serves_its_rank_whatever_the_request_names() {
    let server = start_one(rank_ports(RankPortLoads::PerRank, 0), false).await;
    assert_eq!(server.rank_addrs.len(), 4);
    assert_eq!(server.rank_addrs[0], server.addr);
    for (rank, addr) in server.rank_addrs.iter().enumerate() {
        assert_eq!(usize::from(addr.port()), usize::from(server.addr.port()) + rank);
    }
    let ports: Vec<String> = server.rank_addrs.iter().map(ToString::to_string).collect();
    assert!(server
        .ready_line()
        .ends_with(&format!(" rank_ports={}", ports.join(","))));
    for rank in 0..4 {
        let url = server.rank_url(rank).unwrap();
        let plain = send(
            &url,
            "/generate",
            r#"{"text":"hi","sampling_params":{"max_new_tokens":2}}"#,
            None,
        )
        .await;
        assert_eq!((plain.status, plain.rank), (StatusCode::OK, rank as i64));
        // A rank field or header naming another rank (even one past the
        // group) is ignored: the port selects the rank.
        let other = (rank + 1) % 4;
        let body =
            format!(r#"{{"text":"hi","routed_dp_rank":{other},"sampling_params":{{"max_new_tokens":2}}}}"#);
        assert_eq!(send(&url, "/generate", &body, None).await.rank, rank as i64);
        let chat = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"data_parallel_rank":9}"#;
        assert_eq!(
            send(&url, "/v1/chat/completions", chat, Some("7")).await.rank,
            rank as i64
        );
        // Its type is still checked.
        let bad = send(&url, "/generate", r#"{"text":"hi","routed_dp_rank":"one"}"#, None).await;
        assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    }
    let counters = common::get_json(&server, "/_sim/counters").await;
    assert_eq!(counters["served_per_rank"], json!([3, 3, 3, 3]));
}

fn ranks_of(loads: &Value) -> Vec<u64> {
    loads["loads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| row["dp_rank"].as_u64().unwrap())
        .collect()
}

#[tokio::test]
async fn by_default_each_rank_port_reports_its_own_load_under_its_global_rank() {
    let server = start_one(rank_ports(RankPortLoads::PerRank, 4), false).await;
    for rank in 0..4 {
        let url = server.rank_url(rank).unwrap();
        let (status, text) = fetch(&url, "/v1/loads").await;
        assert_eq!(status, StatusCode::OK);
        let loads: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(ranks_of(&loads), [4 + rank as u64]);
        assert_eq!(loads["dp_rank_count"], 1);
        let (_, text) = fetch(&url, "/get_load").await;
        let legacy: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(legacy.as_array().unwrap().len(), 1);
        assert_eq!(legacy[0]["dp_rank"], 4 + rank);
        // Served requests carry the global rank too.
        let reply = send(
            &url,
            "/generate",
            r#"{"text":"hi","sampling_params":{"max_new_tokens":1}}"#,
            None,
        )
        .await;
        assert_eq!(reply.rank, 4 + rank as i64);
    }
    // A rank's load shows there only.
    common::control(&server, r#"{"base_tokens":[0,0,700,0]}"#).await;
    let (_, text) = fetch(&server.rank_url(2).unwrap(), "/v1/loads").await;
    let loads: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(loads["loads"][0]["num_used_tokens"], 700);
    let (_, text) = fetch(&server.rank_url(1).unwrap(), "/v1/loads").await;
    let loads: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(loads["loads"][0]["num_used_tokens"], 0);
    assert!(server.ready_line().contains(" dp_start_rank=4 rank_ports="));
}

#[tokio::test]
async fn the_whole_worker_s_loads_can_be_on_the_base_port_or_a_port_of_their_own() {
    let base = start_one(rank_ports(RankPortLoads::Base, 0), false).await;
    let (status, text) = fetch(&base.url(), "/v1/loads").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ranks_of(&serde_json::from_str(&text).unwrap()), [0, 1, 2, 3]);
    for rank in 1..4 {
        let url = base.rank_url(rank).unwrap();
        assert_eq!(fetch(&url, "/v1/loads").await.0, StatusCode::NOT_FOUND);
        assert_eq!(fetch(&url, "/get_load").await.0, StatusCode::NOT_FOUND);
    }

    let separate = start_one(rank_ports(RankPortLoads::None, 4), true).await;
    for rank in 0..4 {
        let url = separate.rank_url(rank).unwrap();
        assert_eq!(fetch(&url, "/v1/loads").await.0, StatusCode::NOT_FOUND);
    }
    let loads_url = format!("http://{}", separate.loads_addr.unwrap());
    let (status, text) = fetch(&loads_url, "/v1/loads").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ranks_of(&serde_json::from_str(&text).unwrap()), [4, 5, 6, 7]);
    let (_, text) = fetch(&loads_url, "/get_load").await;
    assert_eq!(
        serde_json::from_str::<Value>(&text)
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        4
    );
    assert_eq!(fetch(&loads_url, "/generate").await.0, StatusCode::NOT_FOUND);
    assert!(separate
        .ready_line()
        .ends_with(&format!(" loads={}", separate.loads_addr.unwrap())));
}

#[test]
fn layout_flags_are_refused_where_they_mean_nothing() {
    let refused = |config: SimConfig, words: &str| {
        let error = config.validate().unwrap_err();
        assert!(error.contains(words), "{error}");
    };
    refused(
        SimConfig {
            dp_start_rank: vec![4],
            ..fast_config()
        },
        "--rank-ports",
    );
    refused(
        SimConfig {
            rank_port_loads: RankPortLoads::Base,
            ..fast_config()
        },
        "--rank-ports",
    );
    refused(
        SimConfig {
            vllm_frontend: VllmFrontend::Rust,
            ..fast_config()
        },
        "--engine vllm",
    );
    refused(
        SimConfig {
            rank_ports: true,
            ..vllm(4, 0, VllmFrontend::Python)
        },
        "SGLang",
    );
}

#[test]
fn the_virtual_time_fleet_serves_the_same_layouts() {
    let tokens = || Prompt::Tokens((0..64).collect());
    // Two nodes of a hybrid DP-8 group, the Python frontend.
    let config = SimConfig {
        dp_start_rank: vec![0, 4],
        ..vllm(4, 0, VllmFrontend::Python)
    };
    let mut fleet = Fleet::new(config, 2).unwrap();
    assert_eq!(running_labels(&fleet.metrics(1)), ["4", "5", "6", "7"]);
    let pinned = fleet
        .submit(0.0, 1, Request::new(tokens(), 2).with_rank_header("2"))
        .unwrap();
    let error = fleet
        .submit(0.0, 1, Request::new(tokens(), 2).with_rank_header("6"))
        .unwrap_err();
    assert_eq!(error, "data_parallel_rank 6 is out of range [0, 4).");
    let reports = fleet.run_to_end();
    let report = reports.iter().find(|r| r.req == pinned).unwrap();
    assert_eq!((report.worker, report.rank), (1, 2));
    assert_eq!(fleet.global_rank(report.worker, report.rank), 6);

    // The Rust frontend: global ranks.
    let config = SimConfig {
        dp_start_rank: vec![0, 4],
        ..vllm(4, 0, VllmFrontend::Rust)
    };
    let mut fleet = Fleet::new(config, 2).unwrap();
    let pinned = fleet
        .submit(0.0, 1, Request::new(tokens(), 2).with_rank_header("6"))
        .unwrap();
    assert_eq!(
        fleet
            .submit(0.0, 1, Request::new(tokens(), 2).with_rank_header("2"))
            .unwrap_err(),
        "data parallel rank 2 is out of range for 4 engine(s)"
    );
    let reports = fleet.run_to_end();
    assert_eq!(reports.iter().find(|r| r.req == pinned).unwrap().rank, 2);

    // External load balancing: eight servers of one engine, labelled 0..7.
    let config = SimConfig {
        dp_start_rank: (0..8).collect(),
        ..vllm(1, 0, VllmFrontend::Python)
    };
    let fleet = Fleet::new(config.clone(), 8).unwrap();
    for worker in 0..8 {
        assert_eq!(running_labels(&fleet.metrics(worker)), [worker.to_string()]);
    }
    assert!(Fleet::new(config, 4).is_err());

    // SGLang rank ports on a second node: loads under global ranks.
    let fleet = Fleet::new(rank_ports(RankPortLoads::PerRank, 4), 1).unwrap();
    assert_eq!(ranks_of(&fleet.v1_loads(0)), [4, 5, 6, 7]);
    assert_eq!(ranks_of(&fleet.rank_v1_loads(0, 2)), [6]);
}

/// The first stdout line of the binary run with `args`.
async fn ready_line(args: &[&str]) -> (tokio::process::Child, String) {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dprank-sim"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    (child, line)
}

#[tokio::test]
async fn the_binary_lists_every_port_of_a_layout_in_its_ready_line() {
    let (_child, line) = ready_line(&[
        "--listen",
        "127.0.0.1:0",
        "--dp-size",
        "2",
        "--instant",
        "--rank-ports",
        "--dp-start-rank",
        "2",
        "--loads-port",
        "0",
    ])
    .await;
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(words[0], "ready", "{line}");
    assert_eq!(
        &words[2..5],
        ["role=regular", "dp_size=2", "dp_start_rank=2"],
        "{line}"
    );
    let ports: Vec<&str> = words[5].strip_prefix("rank_ports=").unwrap().split(',').collect();
    assert_eq!(ports[0], words[1]);
    let loads = words[6].strip_prefix("loads=").unwrap();
    for (rank, port) in ports.iter().enumerate() {
        let reply = send(&format!("http://{port}"), "/generate", r#"{"text":"x"}"#, None).await;
        assert_eq!(reply.rank, 2 + rank as i64);
    }
    let (_, text) = fetch(&format!("http://{loads}"), "/v1/loads").await;
    assert_eq!(ranks_of(&serde_json::from_str(&text).unwrap()), [2, 3]);

    let (_child, line) = ready_line(&[
        "--listen",
        "127.0.0.1:0",
        "--engine",
        "vllm",
        "--dp-size",
        "1",
        "--data-parallel-start-rank",
        "5",
        "--vllm-frontend",
        "rust",
        "--instant",
    ])
    .await;
    assert!(
        line.ends_with("role=regular dp_size=1 engine=vllm-0.14.0 dp_start_rank=5 frontend=rust"),
        "{line}"
    );
}
