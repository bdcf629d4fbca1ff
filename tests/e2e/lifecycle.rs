//! A running Envoy changes: a new filter config arrives through LDS (the
//! listener with the wasm filter lives in a file, replaced atomically), and
//! Envoy is hot-restarted (a second process, epoch 1, takes the listeners over
//! and the first drains and exits). Requests are sent continuously across
//! both; none may fail.

use crate::common::lifecycle::{
    lds_listener_with, loader_requests, render_with_lds, render_with_port, write_lds, Loader, Outcome,
    SharedMemory,
};
use crate::common::process::{free_port, EnvoyProcess, HotRestart, Launch};
use crate::common::{repo_root, start_sims, wait_until, Scenario, Sim, TestDir};
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// Allowance for process scheduling on a shared two-core machine.
const SCHEDULING_SLACK: Duration = Duration::from_millis(300);

/// worker_b rank 2 is the lowest pair; then worker_a rank 3.
const LOADS: [&[u64]; 2] = [&[5000, 4000, 6000, 7000], &[8000, 9000, 3000, 6500]];
const NEW_LOADS_A: &[u64] = &[5000, 4000, 6000, 1000];

fn start_workers(dir: &TestDir) -> Vec<Sim> {
    let sims = start_sims(dir, 2, &["--instant"]);
    for (sim, base) in sims.iter().zip(LOADS) {
        sim.set_base_tokens(base);
    }
    sims
}

/// Every loader request succeeded; returns how many connection-level retries it needed.
fn assert_all_succeeded(outcomes: &[Outcome], what: &str) -> usize {
    let failed: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| !matches!(o.result, Ok((200, _))))
        .collect();
    assert!(
        failed.is_empty(),
        "{what}: {} of {} requests failed: {:?}",
        failed.len(),
        outcomes.len(),
        &failed[..failed.len().min(10)]
    );
    outcomes.iter().map(|o| o.retried.len()).sum()
}

/// The rank field a recorded body carries: (name, rank), or None (passed through).
fn rank_field(body: &Value) -> Option<(&'static str, u64)> {
    ["routed_dp_rank", "data_parallel_rank"]
        .into_iter()
        .find_map(|name| Some((name, body.get(name)?.as_u64()?)))
}

/// Sends probes until they are served by `wanted` (worker, rank), every
/// probe on the old or the new pair; returns how long it took.
fn follows(
    envoy: &EnvoyProcess,
    sims: &[Sim],
    old: (&str, u64),
    wanted: (&str, u64),
    within: Duration,
) -> Duration {
    let client = crate::common::Client::new();
    let start = Instant::now();
    let mut probes = 0;
    loop {
        probes += 1;
        let body = json!({"text": format!("probe {probes}")}).to_string();
        let reply = client.post(
            &envoy.url("/generate"),
            &[("content-type", "application/json")],
            body.as_bytes(),
        );
        assert_eq!(reply.status, 200, "{reply:?}");
        let addr = reply.header("x-sim-worker").expect("x-sim-worker");
        let worker = &sims
            .iter()
            .find(|s| s.addr.to_string() == addr)
            .expect("a worker")
            .name;
        let got = (worker.as_str(), reply.rank() as u64);
        if got == wanted {
            return start.elapsed();
        }
        assert_eq!(
            got, old,
            "probe {probes}: neither the old nor the new lowest pair"
        );
        assert!(
            start.elapsed() < within,
            "still on {got:?} after {:?}",
            start.elapsed()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// /v1/loads polls each worker receives per second over `window`.
fn poll_rates(sims: &[Sim], window: Duration) -> Vec<f64> {
    let before: Vec<u64> = sims.iter().map(|s| s.load_requests("/v1/loads")).collect();
    let start = Instant::now();
    std::thread::sleep(window);
    let elapsed = start.elapsed().as_secs_f64();
    sims.iter()
        .zip(before)
        .map(|(s, b)| (s.load_requests("/v1/loads") - b) as f64 / elapsed)
        .collect()
}

fn assert_rate(rates: &[f64], interval: Duration, what: &str) {
    let expected = 1.0 / interval.as_secs_f64();
    for rate in rates {
        assert!(
            (0.7 * expected..=1.3 * expected).contains(rate),
            "{what}: {rate:.1} polls/s per worker, expected {expected:.1} (one per {interval:?}): {rates:?}"
        );
    }
}

/// A scenario's second filter config (`filter-after.json`), merged into the
/// LDS listener's filter on reload.
fn after_overrides(scenario: &Scenario) -> Value {
    let path = repo_root().join(format!("tests/e2e/{}/filter-after.json", scenario.name));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Replaces the LDS file with the listener's filter config merged with
/// `overrides`; returns once Envoy has accepted the update.
fn reload(envoy: &EnvoyProcess, lds: &Path, overrides: &Value) {
    let updates = || -> u64 {
        envoy
            .stats_matching("listener_manager.lds.update_success")
            .values()
            .sum()
    };
    let before = updates();
    write_lds(lds, &lds_listener_with(lds, overrides));
    wait_until("the LDS update", Duration::from_secs(10), || {
        (updates() > before).then_some(())
    });
}

#[test]
fn filter_config_reloaded_through_lds() {
    let scenario = Scenario::load("reload");
    let interval = Duration::from_millis(scenario.override_u64("poll_interval_ms").expect("set"));
    let dir = TestDir::new(&scenario.name);
    let sims = start_workers(&dir);
    let lds = dir.file("lds.yaml");
    let config = dir.file("envoy.yaml");
    std::fs::write(&config, render_with_lds(&sims, &scenario, free_port(), &lds)).expect("write config");
    let envoy = EnvoyProcess::start(&dir, &config, &Launch::new("envoy"));
    for sim in &sims {
        envoy.wait_for_stat(&format!("poll_ok.{}", sim.name), 1, Duration::from_secs(10));
    }

    let loader = Loader::start(envoy.url("/generate"), "reload", false, Duration::from_millis(5));
    std::thread::sleep(Duration::from_millis(300));
    let changed = loader.started.elapsed();
    reload(&envoy, &lds, &after_overrides(&scenario));
    let applied = loader.started.elapsed();
    std::thread::sleep(Duration::from_millis(700));
    let outcomes = loader.stop();
    let retries = assert_all_succeeded(&outcomes, "across the reload");
    assert_eq!(retries, 0, "new connections need no retry across a reload");

    // Each request as the worker got it: before the change `routed_dp_rank`,
    // after it `data_parallel_rank`, always on the lowest pair.
    let received = loader_requests(&sims, "reload");
    let mut first_legacy = None;
    let mut old_after_new = Vec::new();
    for outcome in &outcomes {
        let (worker, body) = received
            .get(&outcome.seq)
            .unwrap_or_else(|| panic!("request {} reached no worker", outcome.seq));
        let (field, rank) =
            rank_field(body).unwrap_or_else(|| panic!("request {} carries no rank: {body}", outcome.seq));
        assert_eq!(
            (worker.as_str(), rank),
            ("worker_b", 2),
            "request {}: {body}",
            outcome.seq
        );
        if outcome.sent < changed {
            assert_eq!(
                field, "routed_dp_rank",
                "request {} before the change",
                outcome.seq
            );
        }
        if field == "data_parallel_rank" {
            assert!(body.get("routed_dp_rank").is_none(), "{body}");
            first_legacy.get_or_insert(outcome.sent);
        } else if let Some(first) = first_legacy {
            old_after_new.push((outcome.seq, outcome.sent - first));
        }
    }
    let first_legacy = first_legacy.expect("the new config is in force");
    eprintln!(
        "reload: {} requests, none failed; written at {changed:?}, accepted at {applied:?}, first new body \
         at {first_legacy:?}; old bodies after the first new one: {old_after_new:?}",
        outcomes.len()
    );
    // Worker threads switch to the new filter chain one after the other.
    assert!(
        old_after_new
            .iter()
            .all(|(_, after)| *after < Duration::from_millis(200)),
        "the old config was still used 200 ms after the new one: {old_after_new:?}"
    );
    assert!(
        first_legacy < applied + Duration::from_millis(200),
        "the new config took effect {:?} after Envoy accepted it",
        first_legacy.saturating_sub(applied)
    );

    // The new config routes on fresh loads and follows them.
    sims[0].set_base_tokens(NEW_LOADS_A);
    let took = follows(
        &envoy,
        &sims,
        ("worker_b", 2),
        ("worker_a", 3),
        2 * interval + SCHEDULING_SLACK,
    );
    eprintln!("reload: routing followed the loads after {took:?} (poll every {interval:?})");
    let last = sims[0].last_request().body_json();
    assert_eq!(rank_field(&last), Some(("data_parallel_rank", 3)), "{last}");
}

/// A reload that changes what the poller does: a shorter interval and one
/// more worker (the least loaded). The new config's poller should poll at
/// the new interval and poll the new worker, so it gets traffic.
#[test]
fn reloaded_config_takes_over_polling() {
    let scenario = Scenario::load("reload_poller");
    let before = Duration::from_millis(scenario.override_u64("poll_interval_ms").expect("set"));
    let dir = TestDir::new(&scenario.name);
    let mut sims = start_workers(&dir);
    sims.push(Sim::start(&dir, "worker_c", 4, &["--instant"]));
    sims[2].set_base_tokens(&[900, 100, 900, 900]);
    let lds = dir.file("lds.yaml");
    let config = dir.file("envoy.yaml");
    // All three in the cluster; the filter lists worker_a and worker_b.
    std::fs::write(&config, render_with_lds(&sims, &scenario, free_port(), &lds)).expect("write config");
    let two: Vec<Value> = sims[..2]
        .iter()
        .map(|s| json!({"address": s.addr.to_string(), "name": s.name}))
        .collect();
    write_lds(&lds, &lds_listener_with(&lds, &json!({ "workers": two })));
    let envoy = EnvoyProcess::start(&dir, &config, &Launch::new("envoy"));
    for sim in &sims[..2] {
        envoy.wait_for_stat(&format!("poll_ok.{}", sim.name), 1, Duration::from_secs(10));
    }
    assert_eq!(sims[2].load_requests("/v1/loads"), 0);

    let mut after = after_overrides(&scenario);
    let interval = Duration::from_millis(after["poll_interval_ms"].as_u64().expect("set"));
    let three: Vec<Value> = sims
        .iter()
        .map(|s| json!({"address": s.addr.to_string(), "name": s.name}))
        .collect();
    after["workers"] = json!(three);
    reload(&envoy, &lds, &after);
    let applied = Instant::now();
    let within = before + 2 * interval + SCHEDULING_SLACK;
    let took = follows(&envoy, &sims, ("worker_b", 2), ("worker_c", 1), within);
    eprintln!("reload: the added worker got traffic {took:?} after the reload");
    std::thread::sleep((before + interval).saturating_sub(applied.elapsed()));
    let rates = poll_rates(&sims, Duration::from_secs(2));
    eprintln!("reload: {rates:?} polls/s per worker after the reload");
    assert_rate(&rates, interval, "after the reload");
}

#[test]
fn hot_restart_loses_no_request() {
    let scenario = Scenario::load("hot_restart");
    let interval = Duration::from_millis(scenario.override_u64("poll_interval_ms").expect("set"));
    let dir = TestDir::new(&scenario.name);
    let sims = start_workers(&dir);
    let config = dir.file("envoy.yaml");
    std::fs::write(&config, render_with_port(&sims, &scenario, free_port())).expect("write config");
    let base_id_path = dir.file("base-id");
    // Short drain and parent shutdown times (defaults 600 s and 900 s).
    let launch = |label: &str, hot_restart: HotRestart| Launch {
        hot_restart,
        drain_time_s: Some(1),
        parent_shutdown_time_s: Some(2),
        ..Launch::new(label)
    };
    let mut first = EnvoyProcess::start(
        &dir,
        &config,
        &launch(
            "epoch0",
            HotRestart::First {
                base_id_path: base_id_path.clone(),
            },
        ),
    );
    let shm = SharedMemory::of(&base_id_path);
    for sim in &sims {
        first.wait_for_stat(&format!("poll_ok.{}", sim.name), 1, Duration::from_secs(10));
    }
    let url = first.url("/generate");
    // One client on a keep-alive connection, one opening a connection per request.
    let loaders = [
        Loader::start(url.clone(), "pooled", true, Duration::from_millis(5)),
        Loader::start(url, "fresh", false, Duration::from_millis(5)),
    ];
    let clock = loaders[0].started;
    std::thread::sleep(Duration::from_millis(300));
    let restart_at = clock.elapsed();
    let second = EnvoyProcess::start(
        &dir,
        &config,
        &launch(
            "epoch1",
            HotRestart::Next {
                base_id: shm.base_id,
                epoch: 1,
            },
        ),
    );
    let ready_at = clock.elapsed();
    assert_eq!(second.listener, first.listener, "the listener is handed over");
    let status = first.wait_exit(Duration::from_secs(15));
    let exited_at = clock.elapsed();
    assert!(status.success(), "epoch 0 exited with {status}");
    eprintln!(
        "hot restart: epoch 1 started at {restart_at:?}, ready at {ready_at:?}; epoch 0 exited ({status}) at {exited_at:?}"
    );
    std::thread::sleep(Duration::from_millis(500));
    let [pooled, fresh] = loaders.map(Loader::stop);

    let mut report = Vec::new();
    let mut passed_through = Vec::new();
    for (tag, outcomes) in [("pooled", &pooled), ("fresh", &fresh)] {
        let retries = assert_all_succeeded(outcomes, tag);
        let retried: Vec<(u64, &Vec<String>)> = outcomes
            .iter()
            .filter(|o| !o.retried.is_empty())
            .map(|o| (o.seq, &o.retried))
            .collect();
        report.push(format!(
            "{tag}: {} requests, all 200, {retries} connection-level retries {retried:?}",
            outcomes.len()
        ));
        // Every request carried the lowest pair's rank, except those the new
        // process got before its first poll round was complete: passed
        // through (no data yet) or routed on the one worker polled so far.
        let received = loader_requests(&sims, tag);
        for outcome in outcomes.iter() {
            let (worker, body) = received
                .get(&outcome.seq)
                .unwrap_or_else(|| panic!("{tag} request {} reached no worker", outcome.seq));
            match rank_field(body) {
                Some(got) if (worker.as_str(), got) == ("worker_b", ("routed_dp_rank", 2)) => {}
                _ => passed_through.push((outcome.sent, format!("{tag} {}: {worker} {body}", outcome.seq))),
            }
        }
    }
    eprintln!("hot restart: {}", report.join("; "));
    // New connections never need a retry: the listen sockets are handed over.
    assert_eq!(
        fresh.iter().map(|o| o.retried.len()).sum::<usize>(),
        0,
        "{report:?}"
    );
    // A pooled connection the draining process closes may race one request:
    // the client sees the close before any response and resends it.
    assert!(
        pooled.iter().map(|o| o.retried.len()).sum::<usize>() <= 2,
        "{report:?}"
    );
    eprintln!(
        "hot restart: {} requests not on the lowest pair (no full poll round yet): {passed_through:?}",
        passed_through.len()
    );
    for (sent, what) in &passed_through {
        assert!(
            *sent >= restart_at && *sent <= ready_at + interval + SCHEDULING_SLACK,
            "{what}: sent at {sent:?}, not on the lowest pair (epoch 1 ready at {ready_at:?})"
        );
    }

    // The new process polls alone, once per interval, and follows the loads.
    let rates = poll_rates(&sims, Duration::from_millis(1500));
    eprintln!("hot restart: {rates:?} polls/s per worker from the new process");
    assert_rate(&rates, interval, "after the hot restart");
    sims[0].set_base_tokens(NEW_LOADS_A);
    let took = follows(
        &second,
        &sims,
        ("worker_b", 2),
        ("worker_a", 3),
        2 * interval + SCHEDULING_SLACK,
    );
    eprintln!("hot restart: the new process followed the loads after {took:?}");
    drop(second);
    drop(shm);
}
