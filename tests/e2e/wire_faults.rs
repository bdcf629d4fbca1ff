//! Faults at the wire of every call the filter makes, in a real Envoy: a
//! worker's answer to a load poll (SGLang `/v1/loads`, `/get_load`; vLLM
//! `/metrics`), PD's prefill leg, and the admin API read for cluster
//! discovery, broken each way `WireFault` lists (reset, head or body cut
//! short, a bad chunk, a trickle past the time-out, a head too large, a 1xx
//! first, an unasked-for gzip, another endpoint's answer, a kept-alive
//! connection closed between calls). Throughout, eight clients send
//! requests; none may be lost, Envoy's log must show no panic and its VMs
//! no reload, and the broken worker gets what passive health promises: a
//! failed poll (its last snapshot kept until stale), a failed prefill leg
//! answered 502 with a JSON error. docs/requests.md tabulates what a client
//! sees in each fault.
//!
//! `DPRANK_WIRE_REQUESTS=N` sends at least N requests per case (1,000 by
//! default); `DPRANK_WIRE_MEASURE=1` prints the table of losses without
//! failing, to measure a build that loses requests (an older one, through
//! `DPRANK_WASM`).

use crate::common::faulty::{fronted_sim, Intercept, LoadAnswer, LoadFront};
use crate::common::lifecycle::{render_discovery, write_eds};
use crate::common::pd::PdWorld;
use crate::common::process::{cluster_mut, free_port, lb_endpoints, yaml_of, EnvoyProcess, Launch};
use crate::common::traffic::{sglang_body, Outcome, Traffic};
use crate::common::wire::WireFault;
use crate::common::{start_sims, wait_until, Envoy, EnvoyOptions, Scenario, Sim, TestDir};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Clients sending at once.
const CLIENTS: usize = 8;
/// Requests per case, at least (`DPRANK_WIRE_REQUESTS` changes it).
const REQUESTS_PER_CASE: usize = 1000;
/// Polls of the broken worker per case, at least: each one a fault.
const POLLS_PER_CASE: u64 = 3;

fn requests_per_case() -> usize {
    std::env::var("DPRANK_WIRE_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(REQUESTS_PER_CASE)
}

/// Lines of Envoy's log that say a VM failed: a panic, a trap, a reload.
fn vm_failures(envoy: &EnvoyProcess) -> Vec<String> {
    std::fs::read_to_string(envoy.log_path())
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            l.contains("panicked")
                || l.contains("RuntimeError")
                || l.contains("Function: proxy_on")
                || (l.contains("wasm") && l.contains("reload"))
        })
        .map(str::to_string)
        .collect()
}

/// VMs Envoy has created so far (a reload creates one more).
fn vms_created(envoy: &EnvoyProcess) -> u64 {
    envoy
        .stats_matching("wasm.envoy.wasm.runtime.v8.created")
        .values()
        .sum()
}

/// Eight clients until at least `requests` are answered and the front has
/// answered `polls` more calls; every outcome.
fn load_until(
    envoy: &EnvoyProcess,
    path: &str,
    body: fn(u64) -> String,
    front: &LoadFront,
    requests: usize,
    polls: u64,
) -> Vec<Outcome> {
    let polls_before = front.polls();
    let clients: Vec<Traffic> = (0..CLIENTS)
        .map(|_| Traffic::start_with(envoy.url(path), Duration::ZERO, body))
        .collect();
    let started = Instant::now();
    wait_until("requests and faulty calls", Duration::from_secs(120), || {
        let sent: usize = clients.iter().map(|c| c.outcomes().len()).sum();
        (sent >= requests && front.polls() >= polls_before + polls).then_some(())
    });
    let outcomes: Vec<Outcome> = clients.into_iter().flat_map(Traffic::stop).collect();
    eprintln!(
        "  {} requests in {:.1} s, {} calls answered by the front",
        outcomes.len(),
        started.elapsed().as_secs_f64(),
        front.polls() - polls_before
    );
    outcomes
}

/// Measuring, not testing: print what happens and go on.
fn measuring() -> bool {
    std::env::var_os("DPRANK_WIRE_MEASURE").is_some()
}

fn lost(outcomes: &[Outcome]) -> Vec<&Outcome> {
    outcomes.iter().filter(|o| !o.ok()).collect()
}

/// A vLLM completions body: a tiny prompt, one output token.
fn vllm_body(seq: u64) -> String {
    json!({"model": "m", "prompt": format!("background {seq}"), "max_tokens": 1}).to_string()
}

/// The engines whose load answers are broken: the shipped config, the
/// simulator's arguments, the serving path and a request body.
struct Engine {
    label: &'static str,
    scenario: &'static str,
    shipped: &'static str,
    sim_args: &'static [&'static str],
    path: &'static str,
    body: fn(u64) -> String,
}

const SGLANG: Engine = Engine {
    label: "SGLang /v1/loads",
    scenario: "wire_faults",
    shipped: "envoy/dprank.yaml",
    sim_args: &["--instant"],
    path: "/generate",
    body: sglang_body,
};

const SGLANG_GET_LOAD: Engine = Engine {
    label: "SGLang /get_load",
    scenario: "wire_faults_get_load",
    ..SGLANG
};

const VLLM: Engine = Engine {
    label: "vLLM /metrics",
    scenario: "wire_faults_vllm",
    shipped: "envoy/vllm.yaml",
    sim_args: &[
        "--engine",
        "vllm",
        "--cost-model",
        "dense-8b",
        "--time-scale",
        "20",
    ],
    path: "/v1/completions",
    body: vllm_body,
};

/// worker_b's load answers broken each way while eight clients send; worker_a healthy.
fn load_answers_broken_at_the_wire(engine: &Engine) {
    let scenario = Scenario::load(engine.scenario);
    let dir = TestDir::new(engine.scenario);
    let a = Sim::start(&dir, "worker_a", 4, engine.sim_args);
    let (b, fronted) = fronted_sim(&dir, "worker_b", 4, engine.sim_args);
    let sims = vec![a, b];
    let options = EnvoyOptions {
        shipped: engine.shipped,
        ..EnvoyOptions::default()
    };
    let envoy = Envoy::start(&dir, &scenario, &sims, &options);
    for w in ["worker_a", "worker_b"] {
        envoy.wait_for_stat(&format!("poll_ok.{w}"), 1, Duration::from_secs(30));
    }
    let vms = vms_created(&envoy);
    let requests = requests_per_case();
    let mut table = Vec::new();
    for fault in WireFault::ALL {
        eprintln!("{}: {fault:?}", engine.label);
        let (ok_before, failed_before) = (envoy.stat("poll_ok.worker_b"), envoy.stat("poll_failed.worker_b"));
        fronted.front.set(LoadAnswer::Wire(fault));
        let outcomes = load_until(
            &envoy,
            engine.path,
            engine.body,
            &fronted.front,
            requests,
            POLLS_PER_CASE,
        );
        let lost = lost(&outcomes);
        let (ok, failed) = (
            envoy.stat("poll_ok.worker_b") - ok_before,
            envoy.stat("poll_failed.worker_b") - failed_before,
        );
        let failures = vm_failures(&envoy);
        table.push(format!(
            "| {fault:?} | {} | {} | {ok} | {failed} | {} |",
            outcomes.len(),
            lost.len(),
            failures.iter().filter(|l| l.contains("panicked")).count()
        ));
        if measuring() {
            eprintln!("{}", table.last().unwrap());
            fronted.front.set(LoadAnswer::Forward {
                delay: Duration::ZERO,
            });
            std::thread::sleep(Duration::from_secs(2));
            continue;
        }
        assert!(
            lost.is_empty(),
            "{} {fault:?}: {} of {} requests lost: {:#?}",
            engine.label,
            lost.len(),
            outcomes.len(),
            lost.iter().take(5).collect::<Vec<_>>()
        );
        assert!(
            failures.is_empty(),
            "{} {fault:?}: the VM failed:\n{}",
            engine.label,
            failures.join("\n")
        );
        if fault.delivers_answer() == Some(true) {
            assert!(
                ok >= 2,
                "{} {fault:?}: whole answers are good polls ({ok} ok, {failed} failed)",
                engine.label
            );
        } else if fault.delivers_answer().is_none() {
            assert!(
                ok + failed >= 2,
                "{} {fault:?}: each answer is a poll, good or failed",
                engine.label
            );
        } else if fault != WireFault::Trickle {
            // A trickled answer fails at the poll time-out; a new poll
            // waits for the outstanding one (`poll_skipped`).
            assert!(
                failed >= 2,
                "{} {fault:?}: each broken answer is a failed poll ({ok} ok, {failed} failed)",
                engine.label
            );
        } else {
            assert!(
                failed >= 1,
                "{} {fault:?}: a trickle past the time-out is a failed poll",
                engine.label
            );
        }
        // Whole again before the next case: its polls succeed.
        fronted.front.set(LoadAnswer::Forward {
            delay: Duration::ZERO,
        });
        envoy.wait_for_stat(
            "poll_ok.worker_b",
            envoy.stat("poll_ok.worker_b") + 2,
            Duration::from_secs(30),
        );
    }
    eprintln!(
        "{}: requests lost per broken load answer ({} VMs created at the start, {} now)\n| fault | requests | lost | polls ok | polls failed | panics (cumulative) |\n|---|---|---|---|---|---|\n{}",
        engine.label,
        vms,
        vms_created(&envoy),
        table.join("\n")
    );
    if !measuring() {
        assert_eq!(
            vms_created(&envoy),
            vms,
            "{}: no VM was created again (no reload)",
            engine.label
        );
    }
}

#[test]
fn sglang_load_answers_broken_at_the_wire_cost_no_request() {
    load_answers_broken_at_the_wire(&SGLANG);
}

#[test]
fn sglang_get_load_answers_broken_at_the_wire_cost_no_request() {
    load_answers_broken_at_the_wire(&SGLANG_GET_LOAD);
}

#[test]
fn vllm_load_answers_broken_at_the_wire_cost_no_request() {
    load_answers_broken_at_the_wire(&VLLM);
}

/// Faults that leave a call without an answer (a PD prefill leg answered
/// whole by the front would leave its decode leg waiting for a KV cache
/// the prefill worker never made).
const FAILING: [WireFault; 7] = [
    WireFault::ResetBeforeAnyByte,
    WireFault::HeadersCutMidLine,
    WireFault::BodyCutShort,
    WireFault::ChunkedCutMidChunk,
    WireFault::BadChunkSize,
    WireFault::EarlyHintsThenCut,
    WireFault::Trickle,
];

/// PD requests per case, at least.
const PD_REQUESTS_PER_CASE: usize = 150;

/// prefill_b's answers to its prefill legs broken each way (before the
/// first byte, mid-answer, past the prefill time-out) while eight clients
/// send: a request whose leg it was gets a clean 502 naming it, every other
/// request is served, and the filter neither panics nor reloads.
#[test]
fn prefill_legs_broken_at_the_wire_are_answered_502_and_cost_nothing_else() {
    // Prefill ranks: prefill_b rank 1 lowest; decode: decode_a rank 2.
    let loads: [&[u64]; 4] = [
        &[3000, 5000],
        &[4000, 1000],
        &[5000, 6000, 1500, 7000],
        &[4000, 3000, 5000, 6000],
    ];
    let sim_args = ["--time-scale", "20", "--kv-wait-timeout-ms", "1000"];
    let (world, fronted) =
        PdWorld::start_fronted("wire_faults_pd", 2, 4, &sim_args, &loads, Some(Intercept::Posts));
    let front = &fronted.as_ref().expect("prefill_b is fronted").front;
    let vms = vms_created(&world.envoy);
    let prefill_b = world.prefill_sim("prefill_b").addr.to_string();
    let mut table = Vec::new();
    for fault in FAILING {
        eprintln!("PD prefill leg: {fault:?}");
        let failed_before = world.envoy.stat("prefill_failed.prefill_b");
        front.set(LoadAnswer::Wire(fault));
        let outcomes = load_until(
            &world.envoy,
            "/generate",
            sglang_body,
            front,
            PD_REQUESTS_PER_CASE,
            2,
        );
        let mut refused = 0;
        for o in &outcomes {
            if o.ok() {
                continue;
            }
            refused += 1;
            let error: Value = serde_json::from_str(&o.detail)
                .unwrap_or_else(|_| panic!("{fault:?}: not a JSON error: {o:?}"));
            assert_eq!(o.status, 502, "{fault:?}: {o:?}");
            assert_eq!(error["error"]["type"], "prefill_failed", "{fault:?}: {o:?}");
            let message = error["error"]["message"].as_str().unwrap_or_default();
            assert!(
                message.contains(&prefill_b),
                "{fault:?}: the 502 names prefill_b: {message}"
            );
        }
        let failed = world.envoy.stat("prefill_failed.prefill_b") - failed_before;
        table.push(format!(
            "| {fault:?} | {} | {refused} | {failed} |",
            outcomes.len()
        ));
        assert!(refused >= 1, "{fault:?}: some legs went to prefill_b");
        assert_eq!(
            failed, refused as u64,
            "{fault:?}: one failed prefill counted per 502"
        );
        let failures = vm_failures(&world.envoy);
        assert!(
            failures.is_empty(),
            "{fault:?}: the VM failed:\n{}",
            failures.join("\n")
        );
        front.set(LoadAnswer::Forward {
            delay: Duration::ZERO,
        });
        // Legs still trickling end at the prefill time-out.
        std::thread::sleep(Duration::from_millis(1000));
    }
    assert_eq!(
        vms_created(&world.envoy),
        vms,
        "no VM was created again (no reload)"
    );
    eprintln!(
        "PD prefill legs broken at prefill_b\n| fault | requests | 502 | prefill_failed |\n|---|---|---|---|\n{}",
        table.join("\n")
    );
}

/// The admin API's answers to cluster discovery broken each way: the last
/// membership stays (both workers polled and served), each broken read is
/// counted, no request is lost, and the filter neither panics nor reloads.
#[test]
fn admin_reads_broken_at_the_wire_keep_the_last_membership() {
    let scenario = Scenario::load("wire_faults_discovery");
    let dir = TestDir::new(&scenario.name);
    let sims = start_sims(&dir, 2, &["--instant"]);
    let eds = dir.file("eds-sglang.yaml");
    write_eds(&eds, &[&sims[0], &sims[1]]);
    let admin_port = free_port();
    let admin = SocketAddr::from(([127, 0, 0, 1], admin_port));
    let front = LoadFront::intercepting(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        admin,
        Intercept::Everything,
    );
    let mut doc: Value =
        serde_yaml_ng::from_str(&render_discovery(admin_port, &eds, &scenario.filter_overrides))
            .expect("rendered config is YAML");
    cluster_mut(&mut doc, "dprank_admin")["load_assignment"]["endpoints"] = lb_endpoints(&[front.addr]);
    let config = dir.file("envoy.yaml");
    std::fs::write(&config, yaml_of(&doc)).expect("write the config");
    let envoy = EnvoyProcess::start(&dir, &config, &Launch::new("envoy"));
    let stat_of = |sim: &Sim| -> String {
        let addr = sim.addr.to_string();
        addr.chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect()
    };
    for sim in &sims {
        envoy.wait_for_stat(&format!("poll_ok.{}", stat_of(sim)), 1, Duration::from_secs(30));
    }
    let vms = vms_created(&envoy);
    let mut table = Vec::new();
    for fault in WireFault::ALL {
        eprintln!("admin read: {fault:?}");
        let failed_before = envoy.stat("membership_failed");
        let polled_before: Vec<u64> = sims
            .iter()
            .map(|s| envoy.stat(&format!("poll_ok.{}", stat_of(s))))
            .collect();
        front.set(LoadAnswer::Wire(fault));
        let outcomes = load_until(&envoy, "/generate", sglang_body, &front, 300, POLLS_PER_CASE);
        let lost = lost(&outcomes);
        let failed = envoy.stat("membership_failed") - failed_before;
        table.push(format!(
            "| {fault:?} | {} | {} | {failed} |",
            outcomes.len(),
            lost.len()
        ));
        assert!(
            lost.is_empty(),
            "{fault:?}: {} requests lost: {:#?}",
            lost.len(),
            lost.iter().take(5).collect::<Vec<_>>()
        );
        let failures = vm_failures(&envoy);
        assert!(
            failures.is_empty(),
            "{fault:?}: the VM failed:\n{}",
            failures.join("\n")
        );
        if fault.delivers_answer() == Some(false) && fault != WireFault::Trickle {
            assert!(failed >= 2, "{fault:?}: each broken read is counted ({failed})");
        }
        for (sim, before) in sims.iter().zip(polled_before) {
            let now = envoy.stat(&format!("poll_ok.{}", stat_of(sim)));
            assert!(
                now >= before + 2,
                "{fault:?}: {} is still a member and polled",
                sim.name
            );
        }
        front.set(LoadAnswer::Forward {
            delay: Duration::ZERO,
        });
    }
    assert_eq!(vms_created(&envoy), vms, "no VM was created again (no reload)");
    eprintln!(
        "admin reads broken\n| fault | requests | lost | membership_failed |\n|---|---|---|---|\n{}",
        table.join("\n")
    );
}
