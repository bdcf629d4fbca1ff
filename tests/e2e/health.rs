//! Worker health in a real Envoy (issue 14): a worker that fails every
//! request at once while reporting idle ranks (passive health), load reports
//! whose ranks make no sense, hosts Envoy itself reports unhealthy
//! (`envoy_health`), and retries after a worker dies in a fleet of
//! different sizes (the alternates in the route header), with the rank in
//! the body or in headers.

use crate::common::faulty::{fronted_sim, LoadAnswer};
use crate::common::process::{cluster_mut, free_port, lb_endpoints, yaml_of, EnvoyProcess, Launch};
use crate::common::traffic::{Outcome, Traffic};
use crate::common::{
    envoy::{render_config, SHIPPED_CONFIG},
    repo_root, wait_until, wasm_path, Client, Envoy, EnvoyOptions, Reply, Scenario, Sim, TestDir, World,
};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The shipped passive health's probe share and failures before an ejection.
const PROBE_SHARE: f64 = 0.05;
const CONSECUTIVE_FAILURES: usize = 5;

fn post(client: &Client, url: &str, note: &str) -> Reply {
    let body = json!({"text": note, "sampling_params": {"max_new_tokens": 1}}).to_string();
    client.post(url, &[("content-type", "application/json")], body.as_bytes())
}

/// The name of the worker whose address an `x-sim-worker` value is.
fn name_of<'a>(sims: &'a [&Sim], addr: Option<&str>) -> Option<&'a str> {
    let addr = addr?;
    sims.iter()
        .find(|s| s.addr.to_string() == addr)
        .map(|s| s.name.as_str())
}

#[test]
fn a_worker_failing_every_request_at_once_is_no_black_hole() {
    let controls = [json!({}), json!({"serving_fault": "http_500"})];
    let world = World::start(
        "black_hole",
        2,
        &["--instant"],
        &controls,
        EnvoyOptions::default(),
    );
    let health = &world.scenario.filter_overrides["passive_health"];
    let cooldown = health["cooldown_ms"].as_u64().expect("cooldown_ms");
    let max_cooldown = health["max_cooldown_ms"].as_u64().expect("max_cooldown_ms");
    let sims: Vec<&Sim> = world.sims.iter().collect();
    let url = world.envoy.url("/generate");
    let clients = [
        Traffic::start(url.clone(), Duration::from_millis(2)),
        Traffic::start(url, Duration::from_millis(2)),
    ];
    std::thread::sleep(Duration::from_secs(30));

    // The fault is lifted: worker_b must serve again within one cooldown.
    world.sim("worker_b").control(json!({"serving_fault": "none"}));
    let lifted = Instant::now();
    let ejections = world.envoy.stat("ejections.worker_b");
    assert!(ejections >= 1, "worker_b was never ejected");
    let current = (cooldown << (ejections - 1).min(20)).min(max_cooldown);
    let bound = Duration::from_millis(current) + Duration::from_secs(2);
    let back = wait_until("worker_b serving again", bound + Duration::from_secs(10), || {
        clients
            .iter()
            .flat_map(|c| c.outcomes())
            .filter(|o| o.sent >= lifted && o.ok())
            .find(|o| name_of(&sims, o.worker.as_deref()) == Some("worker_b"))
            .map(|o| o.done.duration_since(lifted))
    });
    let outcomes: Vec<Outcome> = {
        let mut all: Vec<Outcome> = clients.into_iter().flat_map(Traffic::stop).collect();
        all.sort_by_key(|o| o.sent);
        all
    };

    let faulty: Vec<&Outcome> = outcomes.iter().filter(|o| o.sent < lifted).collect();
    let failed: Vec<&&Outcome> = faulty.iter().filter(|o| !o.ok()).collect();
    let on_b = |o: &&&Outcome| name_of(&sims, o.worker.as_deref()) == Some("worker_b");
    // The first few failures eject worker_b (a request per client in flight
    // then may still fail: within the share below).
    let first_few = CONSECUTIVE_FAILURES;
    let after_first = faulty
        .iter()
        .enumerate()
        .filter(|(_, o)| !o.ok())
        .nth(first_few - 1)
        .map(|(i, _)| i + 1)
        .expect("worker_b failed its first requests");
    let later = &faulty[after_first..];
    let later_on_b = later.iter().filter(|o| on_b(o)).count();
    eprintln!(
        "black hole: {} requests in 30 s, {} failed ({:.2}%); after the first {first_few} failures \
         worker_b got {later_on_b} of {} ({:.2}%, probe share {:.0}%); {ejections} ejections; \
         back {back:?} after the fault was lifted (cooldown then {current} ms)",
        faulty.len(),
        failed.len(),
        100.0 * failed.len() as f64 / faulty.len() as f64,
        later.len(),
        100.0 * later_on_b as f64 / later.len().max(1) as f64,
        100.0 * PROBE_SHARE
    );
    assert!(
        faulty.len() >= 500,
        "too little traffic to judge: {}",
        faulty.len()
    );
    assert!(
        failed.len() as f64 <= 0.05 * faulty.len() as f64,
        "{} of {} requests failed",
        failed.len(),
        faulty.len()
    );
    assert!(
        failed.iter().all(|o| o.status == 500 && on_b(o)),
        "only worker_b's own 500s: {:?}",
        failed.iter().find(|o| !(o.status == 500 && on_b(o)))
    );
    assert!(
        later_on_b as f64 <= PROBE_SHARE * later.len() as f64,
        "worker_b got {later_on_b} of the {} requests after its first failures",
        later.len()
    );
    assert!(ejections >= 2, "its failed probes ejected it again ({ejections})");
    assert!(back <= bound, "worker_b came back after {back:?}, over {bound:?}");
    assert!(world.envoy.stat("failures.worker_b") >= failed.len() as u64);
    assert_eq!(world.envoy.stat("failures.worker_a"), 0);
    wait_until("worker_b's gauge back to 0", Duration::from_secs(5), || {
        (world.envoy.stat("health.worker_b") == 0).then_some(())
    });
}

#[test]
fn load_reports_with_senseless_ranks_never_put_a_rank_into_a_request() {
    let scenario = Scenario::load("rank_sanity");
    let interval = Duration::from_millis(scenario.override_u64("poll_interval_ms").expect("set"));
    let stale = 3 * interval;
    let dir = TestDir::new(&scenario.name);
    let a = Sim::start(&dir, "worker_a", 4, &["--instant"]);
    a.set_base_tokens(&[5000, 5000, 5000, 5000]);
    // worker_b and worker_c: handles at their fronts' addresses (the ones
    // dprank knows), and the fronts with the simulators behind them.
    let (b, b_front) = fronted_sim(&dir, "worker_b", 4, &["--instant"]);
    b.set_base_tokens(&[1000, 6000, 6000, 6000]);
    let (c, c_front) = fronted_sim(&dir, "worker_c", 4, &["--instant"]);
    // The report of issue 14: rank 99 on a worker with no dp_rank_count, idle.
    let rank_99 = r#"{"loads":[{"dp_rank":0,"num_total_tokens":0},{"dp_rank":99,"num_total_tokens":0}]}"#;
    c_front.front.set(LoadAnswer::Fixed(rank_99.to_string()));
    let sims = [a, b, c];
    let envoy = Envoy::start(&dir, &scenario, &sims, &EnvoyOptions::default());
    let slow = Duration::from_secs(30);
    for w in ["worker_a", "worker_b"] {
        envoy.wait_for_stat(&format!("poll_ok.{w}"), 1, slow);
    }
    envoy.wait_for_stat("report_refused.worker_c", 2, slow);
    let client = Client::new();
    let url = envoy.url("/generate");
    let names = [
        (sims[0].addr.to_string(), "worker_a"),
        (b_front.backend.addr.to_string(), "worker_b"),
        (c_front.backend.addr.to_string(), "worker_c"),
    ];
    let send = |note: &str| {
        let reply = post(&client, &url, note);
        assert_eq!(reply.status, 200, "{note}: {reply:?}");
        let addr = reply.header("x-sim-worker").expect("answered by a worker");
        let name = names.iter().find(|(a, _)| a == addr).expect("a known worker").1;
        (name, reply.rank())
    };
    assert_eq!(send("sensible"), ("worker_b", 0));

    let reports = [
        ("ranks {0, 99}", rank_99.to_string()),
        (
            "a duplicate",
            r#"[{"dp_rank":0,"num_tokens":0},{"dp_rank":1,"num_tokens":0},{"dp_rank":1,"num_tokens":0},{"dp_rank":2,"num_tokens":0}]"#
                .to_string(),
        ),
        (
            "a gap",
            r#"{"dp_rank_count":4,"loads":[{"dp_rank":0,"num_total_tokens":0},{"dp_rank":1,"num_total_tokens":0},{"dp_rank":3,"num_total_tokens":0}]}"#
                .to_string(),
        ),
    ];
    let mut sent = 0;
    for (what, report) in &reports {
        let refused = envoy.stat("report_refused.worker_b");
        b_front.front.set(LoadAnswer::Fixed(report.clone()));
        envoy.wait_for_stat("report_refused.worker_b", refused + 1, slow);
        let changed = Instant::now();
        // The last good snapshot serves until it is stale, then worker_a.
        let left = wait_until(
            &format!("{what}: worker_b left"),
            stale + Duration::from_secs(5),
            || {
                sent += 1;
                let (worker, rank) = send(what);
                assert!(
                    (worker, rank) == ("worker_b", 0) || worker == "worker_a",
                    "{what}: served by {worker} rank {rank}"
                );
                (worker == "worker_a").then(|| changed.elapsed())
            },
        );
        for i in 0..5 {
            assert_eq!(
                send(&format!("{what} {i}")).0,
                "worker_a",
                "{what}: worker_b is stale"
            );
        }
        eprintln!("rank sanity: {what}: refused; worker_a serving {left:?} after the change");
    }
    // Every routed request carried a rank below 4, and worker_c (never a
    // sensible report) got none at all.
    for sim in [&sims[0], &b_front.backend] {
        for r in sim.requests() {
            let rank = r.body_json()["routed_dp_rank"].as_u64();
            assert!(rank.is_some_and(|r| r < 4), "{}: {}", sim.name, r.body_text());
        }
    }
    assert!(c_front.backend.requests().is_empty(), "worker_c was never chosen");
    assert_eq!(envoy.stat("poll_ok.worker_c"), 0);
    let log = std::fs::read_to_string(dir.file("envoy.log")).expect("Envoy's log");
    let refusals = |w: &Sim| {
        log.lines()
            .filter(|l| l.contains(&format!("refusing the load reports of {}", w.addr)))
            .count()
    };
    assert_eq!(
        refusals(&sims[1]),
        1,
        "worker_b: logged once over three bad reports"
    );
    assert_eq!(refusals(&sims[2]), 1, "worker_c: logged once");
    assert!(envoy.stat("report_refused.worker_c") >= 5);

    // A sensible report again: worker_b back, and the recovery is logged.
    b_front.front.set(LoadAnswer::Forward {
        delay: Duration::ZERO,
    });
    wait_until("worker_b back", stale + Duration::from_secs(5), || {
        (send("sensible again") == ("worker_b", 0)).then_some(())
    });
    eprintln!(
        "rank sanity: {sent} requests while the reports were refused, none with a rank the worker lacks"
    );
}

/// `envoy/dprank.yaml` rendered for `sims`, with the admin API on a known
/// port and a `dprank_admin` cluster pointing at it, outlier detection on
/// the workers' cluster, and `draining` endpoints marked `DRAINING`.
fn render_with_envoy_health(scenario: &Scenario, sims: &[Sim], draining: &[&Sim]) -> String {
    let shipped = std::fs::read_to_string(repo_root().join(SHIPPED_CONFIG)).expect("the shipped config");
    let workers: Vec<(&str, SocketAddr)> = sims.iter().map(|s| (s.name.as_str(), s.addr)).collect();
    let rendered = render_config(&shipped, &workers, &scenario.filter_overrides, &wasm_path(), None);
    let mut doc: Value = serde_yaml_ng::from_str(&rendered).expect("rendered config is YAML");
    let admin_port = free_port();
    doc["admin"]["address"]["socket_address"]["port_value"] = json!(admin_port);
    let sglang = cluster_mut(&mut doc, "sglang");
    sglang["outlier_detection"] = json!({
        "consecutive_5xx": 3,
        "interval": "0.5s",
        "base_ejection_time": "2s",
        "max_ejection_time": "2s",
        "max_ejection_percent": 100
    });
    for endpoint in sglang["load_assignment"]["endpoints"][0]["lb_endpoints"]
        .as_array_mut()
        .expect("lb_endpoints")
    {
        let port = endpoint["endpoint"]["address"]["socket_address"]["port_value"].as_u64();
        if draining.iter().any(|s| Some(u64::from(s.addr.port())) == port) {
            endpoint["health_status"] = json!("DRAINING");
        }
    }
    let admin = SocketAddr::from(([127, 0, 0, 1], admin_port));
    doc["static_resources"]["clusters"]
        .as_array_mut()
        .expect("clusters")
        .push(json!({
            "name": "dprank_admin",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "dprank_admin", "endpoints": lb_endpoints(&[admin])}
        }));
    yaml_of(&doc)
}

#[test]
fn hosts_envoy_reports_unhealthy_are_not_chosen() {
    let scenario = Scenario::load("envoy_health");
    let dir = TestDir::new(&scenario.name);
    let sims = crate::common::start_sims(&dir, 3, &["--instant"]);
    sims[0].set_base_tokens(&[5000, 5000, 5000, 5000]);
    sims[1].control(json!({"serving_fault": "http_500"}));
    let config = dir.file("envoy.yaml");
    std::fs::write(&config, render_with_envoy_health(&scenario, &sims, &[&sims[2]])).expect("write config");
    let envoy = EnvoyProcess::start(&dir, &config, &Launch::new("envoy"));
    let slow = Duration::from_secs(30);
    for s in &sims {
        envoy.wait_for_stat(&format!("poll_ok.{}", s.name), 1, slow);
    }
    wait_until("worker_c known as draining", slow, || {
        (envoy.stat("health.worker_c") == 3).then_some(())
    });
    let client = Client::new();
    let url = envoy.url("/generate");
    let refs: Vec<&Sim> = sims.iter().collect();
    let served = |reply: &Reply| {
        name_of(&refs, reply.header("x-sim-worker"))
            .unwrap_or("none")
            .to_string()
    };

    // worker_b (idle) is chosen and answers 500 until Envoy ejects it; worker_c
    // (idle too, but draining) never is.
    let mut to_b = 0;
    wait_until(
        "Envoy's outlier detection ejecting worker_b, seen by dprank",
        slow,
        || {
            let reply = post(&client, &url, "until ejected");
            match served(&reply).as_str() {
                "worker_b" => {
                    assert_eq!(reply.status, 500);
                    to_b += 1;
                }
                other => assert_eq!((other, reply.status), ("worker_a", 200)),
            }
            (envoy.stat("health.worker_b") == 3).then_some(())
        },
    );
    assert!(to_b >= 3, "outlier detection needs 3 failures, saw {to_b}");
    for i in 0..30 {
        let reply = post(&client, &url, &format!("ejected {i}"));
        assert_eq!((served(&reply).as_str(), reply.status), ("worker_a", 200), "{i}");
    }
    assert!(sims[2].requests().is_empty(), "the draining worker got requests");
    let ejections = envoy.stats_matching("outlier_detection.ejections_enforced_consecutive_5xx");
    eprintln!("envoy health: worker_b chosen {to_b} times before Envoy ejected it; {ejections:?}");

    // Fixed, and let back in by Envoy: chosen again (it is the least loaded).
    sims[1].control(json!({"serving_fault": "none"}));
    let fixed = Instant::now();
    wait_until("worker_b chosen again", slow, || {
        let reply = post(&client, &url, "back");
        (served(&reply) == "worker_b" && reply.status == 200).then_some(())
    });
    eprintln!(
        "envoy health: worker_b back {:?} after its fault was lifted",
        fixed.elapsed()
    );
    assert!(sims[2].requests().is_empty());
}

#[test]
fn retries_after_a_worker_dies_carry_a_rank_the_next_worker_has() {
    retries_land_where_the_rank_is("retry_alternates");
}

/// The same in header mode: Envoy's retries re-send dprank's rank headers,
/// so the alternates must have that rank just as when it is in the body.
#[test]
fn retries_in_header_mode_carry_a_rank_the_next_worker_has() {
    retries_land_where_the_rank_is("header_retry_alternates");
}

/// Workers of 4, 2 and 4 ranks; the first dies, then the third (see the
/// scenario's README).
fn retries_land_where_the_rank_is(scenario: &str) {
    let scenario = Scenario::load(scenario);
    let dir = TestDir::new(&scenario.name);
    let a = Sim::start(&dir, "worker_a", 4, &["--instant"]);
    let b = Sim::start(&dir, "worker_b", 2, &["--instant"]);
    let c = Sim::start(&dir, "worker_c", 4, &["--instant"]);
    a.set_base_tokens(&[9000, 9000, 9000, 0]);
    b.set_base_tokens(&[5000, 5000]);
    c.set_base_tokens(&[9000, 9000, 9000, 100]);
    let sims = [a, b, c];
    let envoy = Envoy::start(&dir, &scenario, &sims, &EnvoyOptions::default());
    for s in &sims {
        envoy.wait_for_stat(&format!("poll_ok.{}", s.name), 1, Duration::from_secs(30));
    }
    let [a, b, c] = &sims;
    let (a_addr, b_addr, c_addr) = (a.addr.to_string(), b.addr.to_string(), c.addr.to_string());
    let client = Client::new();
    let url = envoy.url("/generate");
    let reply = post(&client, &url, "all up");
    assert_eq!(
        (reply.header("x-sim-worker"), reply.rank()),
        (Some(a_addr.as_str()), 3)
    );
    let routed_to_a = envoy.stat("routed.worker_a.rank_3");

    // worker_a dies. Its data stays fresh for seconds: requests are still
    // routed there, and Envoy retries them on worker_c, the alternate with rank 3.
    let mut sims = sims;
    sims[0].kill();
    let killed = Instant::now();
    for i in 0..20 {
        let reply = post(&client, &url, &format!("a down {i}"));
        assert_eq!(reply.status, 200, "{i}: {reply:?}");
        assert_eq!(
            (reply.header("x-sim-worker"), reply.rank()),
            (Some(c_addr.as_str()), 3),
            "{i}: worker_c, on the rank dprank chose"
        );
    }
    let during = killed.elapsed();
    let routed_to_dead = envoy.stat("routed.worker_a.rank_3") - routed_to_a;
    let retried = envoy.stat("retry.to_alternate");
    eprintln!(
        "retry alternates: in {during:?} after worker_a died, {routed_to_dead} requests routed to it, \
         {retried} retried on worker_c; worker_a ejected {} time(s)",
        envoy.stat("ejections.worker_a")
    );
    assert!(
        during < Duration::from_secs(5),
        "the test ran past the stale window"
    );
    assert!(routed_to_dead >= CONSECUTIVE_FAILURES as u64, "{routed_to_dead}");
    assert_eq!(
        retried, routed_to_dead,
        "every one of them retried on the alternate"
    );
    assert_eq!(envoy.stat("ejections.worker_a"), 1, "passive health ejected it");
    assert!(
        sims[1].requests().is_empty(),
        "worker_b lacks rank 3: never tried"
    );

    // worker_c dies too: no fresh worker in rotation has rank 3 any more, so
    // the route header names worker_c alone, and its retry goes to the
    // fallback policy, which can only find worker_b (2 ranks): its 400 goes
    // to the client. Passive health ejects worker_c after a few; then
    // worker_b is chosen, on its own ranks.
    let no_alternate = envoy.stat("retry.no_alternate");
    sims[2].kill();
    let mut statuses = Vec::new();
    wait_until("routing on worker_b alone", Duration::from_secs(5), || {
        let reply = post(&client, &url, "c down");
        assert_eq!(reply.header("x-sim-worker"), Some(b_addr.as_str()), "{reply:?}");
        statuses.push(reply.status);
        (reply.status == 200).then_some(())
    });
    let rejected = statuses.iter().filter(|s| **s == 400).count();
    eprintln!("retry alternates: worker_c down, no alternate: statuses {statuses:?}");
    assert!(
        statuses[..statuses.len() - 1].iter().all(|s| *s == 400),
        "{statuses:?}"
    );
    assert!((1..=CONSECUTIVE_FAILURES).contains(&rejected), "{statuses:?}");
    assert!(envoy.stat("retry.no_alternate") >= no_alternate + rejected as u64);
    assert!(envoy.stat("retry.to_fallback") >= rejected as u64);
    assert_eq!(envoy.stat("ejections.worker_c"), 1);
}
