//! Deployment layouts in a real Envoy: two nodes of one vLLM DP-8
//! deployment with hybrid load balancing (engines 0-3 and 4-7, the shipped
//! `envoy/vllm-hybrid.yaml`) with vLLM's default Python frontend (it reads
//! the local index) and its Rust frontend (the global rank); a rank value
//! of the wrong numbering costs one failed request per node, then dprank
//! writes the right one; external load balancing (one engine per server,
//! labelled 0..7: no rank header); a server restarted with fewer engines
//! costs at most one failed request before dprank adapts.

use crate::common::process::EnvoyProcess;
use crate::common::traffic::{Outcome, Traffic};
use crate::common::{Envoy, EnvoyOptions, Scenario, Sim, TestDir};
use serde_json::json;
use std::time::Duration;

/// vLLM's scheduler on a dense 8B model, twenty times faster than real.
const VLLM: [&str; 6] = [
    "--engine",
    "vllm",
    "--cost-model",
    "dense-8b",
    "--time-scale",
    "20",
];

fn completion(seq: u64) -> String {
    json!({"model": "m", "prompt": format!("layouts {seq}"), "max_tokens": 1}).to_string()
}

/// Starts servers (`name`, extra simulator arguments, engines) behind the
/// rendered `shipped` config with the scenario's overrides.
fn start(
    scenario: &str,
    shipped: &'static str,
    servers: &[(&str, Vec<String>, u32)],
) -> (TestDir, Vec<Sim>, Envoy) {
    let scenario = Scenario::load(scenario);
    let dir = TestDir::new(&scenario.name);
    let sims: Vec<Sim> = servers
        .iter()
        .map(|(name, extra, engines)| {
            let args: Vec<&str> = VLLM
                .iter()
                .copied()
                .chain(extra.iter().map(String::as_str))
                .collect();
            Sim::start(&dir, name, *engines, &args)
        })
        .collect();
    let envoy = Envoy::start(
        &dir,
        &scenario,
        &sims,
        &EnvoyOptions {
            shipped,
            ..EnvoyOptions::default()
        },
    );
    for sim in &sims {
        envoy.wait_for_stat(&format!("poll_ok.{}", sim.name), 1, Duration::from_secs(30));
    }
    (dir, sims, envoy)
}

/// Sends one completion; (status, server, engine as the server names it,
/// the rank header it saw).
fn send(envoy: &EnvoyProcess, sims: &[Sim], seq: u64) -> (u16, String, Option<u64>, Option<String>) {
    let reply = crate::common::Client::new().post(
        &envoy.url("/v1/completions"),
        &[("content-type", "application/json")],
        completion(seq).as_bytes(),
    );
    let Some(addr) = reply.header("x-sim-worker") else {
        return (reply.status, String::new(), None, None);
    };
    let sim = sims
        .iter()
        .find(|s| s.addr.to_string() == addr)
        .expect("a started server");
    let recorded = sim.last_request();
    (
        reply.status,
        sim.name.clone(),
        recorded.rank,
        recorded.header("x-data-parallel-rank").map(str::to_string),
    )
}

/// Every engine busy (waiting requests) but `idle` (server, local index).
fn busy_but(sims: &[Sim], idle: (usize, usize)) {
    for (i, sim) in sims.iter().enumerate() {
        let waiting: Vec<u64> = (0..4).map(|e| if (i, e) == idle { 0 } else { 20 }).collect();
        sim.control(json!({ "base_waiting": waiting }));
    }
}

/// Waits until the requests go to (server, global engine); returns the
/// header the last one carried.
fn follows(envoy: &EnvoyProcess, sims: &[Sim], server: &str, engine: u64) -> Option<String> {
    crate::common::wait_until(
        &format!("requests on {server} engine {engine}"),
        Duration::from_secs(10),
        || {
            let (status, name, rank, header) = send(envoy, sims, 0);
            assert_eq!(status, 200, "no request fails");
            (name == server && rank == Some(engine)).then_some(header)
        },
    )
}

/// Eight clients until `n` requests are answered: their outcomes.
fn load(envoy: &EnvoyProcess, n: usize) -> Vec<Outcome> {
    let clients: Vec<Traffic> = (0..8)
        .map(|_| Traffic::start_with(envoy.url("/v1/completions"), Duration::ZERO, completion))
        .collect();
    crate::common::wait_until("requests answered", Duration::from_secs(120), || {
        (clients.iter().map(|c| c.outcomes().len()).sum::<usize>() >= n).then_some(())
    });
    clients.into_iter().flat_map(Traffic::stop).collect()
}

fn hybrid(scenario: &str, frontend: &str) -> (TestDir, Vec<Sim>, Envoy) {
    let node = |start: u32| -> Vec<String> {
        let mut args = vec!["--dp-start-rank".to_string(), start.to_string()];
        args.extend(["--vllm-frontend".to_string(), frontend.to_string()]);
        args
    };
    start(
        scenario,
        "envoy/vllm-hybrid.yaml",
        &[("node_1", node(0), 4), ("node_2", node(4), 4)],
    )
}

fn follows_the_idle_engine_on_either_node(scenario: &str, frontend: &str, values: [&str; 2]) {
    let (_dir, sims, envoy) = hybrid(scenario, frontend);
    // Engine 6 (node 2's third) idle, every other busy: node 2, written as
    // the frontend reads it.
    busy_but(&sims, (1, 2));
    assert_eq!(follows(&envoy, &sims, "node_2", 6).as_deref(), Some(values[1]));
    assert!(
        envoy.stat("routed.node_2.rank_6") >= 1,
        "counted by the server's rank"
    );
    // Engine 1 idle: node 1.
    busy_but(&sims, (0, 1));
    assert_eq!(follows(&envoy, &sims, "node_1", 1).as_deref(), Some(values[0]));
    // Eight clients, every engine as loaded: no 400, no other failure.
    busy_but(&sims, (9, 9));
    let outcomes = load(&envoy, 1000);
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.ok()).collect();
    assert!(
        failed.is_empty(),
        "{} of {} failed: {:?}",
        failed.len(),
        outcomes.len(),
        failed.first()
    );
    let on = |node: &str| {
        (0..8)
            .map(|r| envoy.stat(&format!("routed.{node}.rank_{r}")))
            .sum::<u64>()
    };
    assert!(
        on("node_1") > 100 && on("node_2") > 100,
        "both nodes serve: {} / {}",
        on("node_1"),
        on("node_2")
    );
    assert_eq!(envoy.stat("report_refused.node_2"), 0);
    assert_eq!(envoy.stat("rank_refused.node_2"), 0);
}

#[test]
fn hybrid_two_nodes_python_frontend_get_the_local_index() {
    follows_the_idle_engine_on_either_node("layouts_hybrid", "python", ["1", "2"]);
}

#[test]
fn hybrid_two_nodes_rust_frontend_get_the_global_rank() {
    follows_the_idle_engine_on_either_node("layouts_hybrid_global", "rust", ["1", "6"]);
}

#[test]
fn a_wrong_numbering_costs_one_request_per_node_then_adapts() {
    // The Rust frontend behind the default (local) numbering.
    let (_dir, sims, envoy) = hybrid("layouts_hybrid", "rust");
    busy_but(&sims, (1, 2));
    let mut refused = Vec::new();
    let header = crate::common::wait_until("node 2's engine 6 pinned", Duration::from_secs(10), || {
        let (status, name, rank, header) = send(&envoy, &sims, 0);
        if status != 200 {
            refused.push(status);
            return None;
        }
        (name == "node_2" && rank == Some(6)).then_some(header)
    });
    assert_eq!(refused, [400], "one failed request");
    assert_eq!(header.as_deref(), Some("6"), "the global rank from then on");
    assert_eq!(envoy.stat("rank_refused.node_2"), 1);
    // Node 1's ranks start at 0: both numberings agree, nothing to learn.
    busy_but(&sims, (0, 3));
    assert_eq!(follows(&envoy, &sims, "node_1", 3).as_deref(), Some("3"));
    let outcomes = load(&envoy, 300);
    assert!(outcomes.iter().all(Outcome::ok), "nothing fails once learned");
}

#[test]
fn external_load_balancing_servers_of_one_engine_get_no_rank_header() {
    let servers: Vec<(String, Vec<String>)> = (0..8)
        .map(|r| {
            (
                format!("engine_{r}"),
                vec!["--dp-start-rank".to_string(), r.to_string()],
            )
        })
        .collect();
    let specs: Vec<(&str, Vec<String>, u32)> =
        servers.iter().map(|(n, a)| (n.as_str(), a.clone(), 1)).collect();
    let (_dir, sims, envoy) = start("layouts_external", "envoy/vllm.yaml", &specs);
    for idle in [5usize, 2] {
        for (i, sim) in sims.iter().enumerate() {
            sim.control(json!({"base_waiting": [if i == idle { 0 } else { 20 }]}));
        }
        let server = format!("engine_{idle}");
        let header = follows(&envoy, &sims, &server, idle as u64);
        assert_eq!(header, None, "a server of one engine gets no rank header");
        assert!(envoy.stat(&format!("routed.{server}.rank_{idle}")) >= 1);
    }
}

#[test]
fn a_server_restarted_with_fewer_engines_costs_at_most_one_request() {
    use crate::common::faulty::SimProcess;
    // Polls every 10 s: the restart is learned from the refusal, not a poll.
    let (dir, mut sims, envoy) = start(
        "layouts_restart",
        "envoy/vllm.yaml",
        &[("server_a", vec![], 4), ("server_b", vec![], 4)],
    );
    // server_b's engine 3 idle.
    busy_but(&sims, (1, 3));
    assert_eq!(follows(&envoy, &sims, "server_b", 3).as_deref(), Some("3"));
    let addr = sims[1].addr;
    sims[1].kill();
    let args: Vec<&str> = VLLM.to_vec();
    let _restarted = SimProcess::start_at(&dir, "server_b-2", addr, 2, &args);
    let statuses: Vec<u16> = (0..20).map(|i| send(&envoy, &sims, i).0).collect();
    let failed = statuses.iter().filter(|s| **s != 200).count();
    assert!(failed <= 1, "at most one failed request: {statuses:?}");
    assert!(envoy.stat("rank_refused.server_b") <= 1);
}

/// SGLang's Rust server: each rank on its own port (`--rank-ports`), each
/// port reporting its own rank's load. Two such workers of four ranks, the
/// shipped `envoy/dprank.yaml` with `rank_ports` and every rank port in the
/// cluster: each request goes to its rank's port, with no rank in its body,
/// and follows the least-loaded rank across both workers.
#[test]
fn sglang_one_port_per_rank_balances_by_rank() {
    use crate::common::envoy::render_config;
    use crate::common::process::{cluster_mut, lb_endpoints, yaml_of, Launch};
    use crate::common::{repo_root, wasm_path};
    use std::net::SocketAddr;
    let scenario = Scenario::load("layouts_rank_ports");
    let dir = TestDir::new(&scenario.name);
    let sims: Vec<Sim> = ["worker_a", "worker_b"]
        .iter()
        .map(|name| Sim::start(&dir, name, 4, &["--instant", "--rank-ports"]))
        .collect();
    let shipped = std::fs::read_to_string(repo_root().join("envoy/dprank.yaml")).expect("the shipped config");
    let workers: Vec<(&str, SocketAddr)> = sims.iter().map(|s| (s.name.as_str(), s.addr)).collect();
    let rendered = render_config(&shipped, &workers, &scenario.filter_overrides, &wasm_path(), None);
    let mut doc: serde_json::Value = serde_yaml_ng::from_str(&rendered).expect("YAML");
    let ports: Vec<SocketAddr> = sims
        .iter()
        .flat_map(|s| (0..4).map(move |r| SocketAddr::new(s.addr.ip(), s.addr.port() + r)))
        .collect();
    cluster_mut(&mut doc, "sglang")["load_assignment"]["endpoints"] = lb_endpoints(&ports);
    let config = dir.file("envoy.yaml");
    std::fs::write(&config, yaml_of(&doc)).expect("write the config");
    let envoy = EnvoyProcess::start(&dir, &config, &Launch::new("envoy"));
    for sim in &sims {
        envoy.wait_for_stat(&format!("poll_ok.{}", sim.name), 1, Duration::from_secs(30));
    }
    let client = crate::common::Client::new();
    let body =
        json!({"text": "one port per rank", "routed_dp_rank": 3, "sampling_params": {"max_new_tokens": 1}});
    for (loads, (worker, rank)) in [
        (
            [[5000, 5000, 5000, 5000], [6000, 100, 6000, 6000]],
            (1usize, 1u64),
        ),
        ([[5000, 5000, 5000, 200], [6000, 6000, 6000, 6000]], (0, 3)),
    ] {
        for (sim, base) in sims.iter().zip(loads) {
            sim.set_base_tokens(&base);
        }
        crate::common::wait_until("the least-loaded rank's port", Duration::from_secs(10), || {
            let reply = client.post(
                &envoy.url("/generate"),
                &[("content-type", "application/json")],
                body.to_string().as_bytes(),
            );
            assert_eq!(reply.status, 200, "{reply:?}");
            let served = sims[worker].requests().pop();
            served
                .filter(|r| r.body_json()["text"] == "one port per rank" && r.rank == Some(rank))
                .map(|recorded| {
                    assert!(
                        recorded.body_json()["routed_dp_rank"].is_null(),
                        "the port selects the rank: {recorded:?}"
                    );
                })
        });
        assert!(envoy.stat(&format!("routed.{}.rank_{rank}", sims[worker].name)) >= 1);
    }
    assert_eq!(
        envoy.stat("poll_failed.worker_a") + envoy.stat("poll_failed.worker_b"),
        0
    );
}
