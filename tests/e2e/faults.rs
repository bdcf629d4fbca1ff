//! Failures of the load endpoint never cost a client its answer: the failing
//! worker's data goes stale, routing continues on the healthy one, and with no
//! fresh data at all requests pass through untouched.

use crate::common::{wait_until, EnvoyOptions, World};
use serde_json::json;
use std::time::{Duration, Instant};

const INTERVAL: Duration = Duration::from_millis(200);
/// The shipped default: three intervals.
const STALE_AFTER: Duration = Duration::from_millis(600);

/// Sends one request; every answer must be a 200 from a worker.
fn send_ok(world: &World, note: &str) -> (String, i64) {
    let body = json!({"text": note, "sampling_params": {"max_new_tokens": 1}}).to_string();
    let reply = world.post("/generate", &body);
    assert_eq!(reply.status, 200, "{note}: {reply:?}");
    world.served_by(&reply)
}

/// Sends requests until one is served by `wanted` (all must succeed); panics
/// after `within`. Returns how long it took.
fn routed_to_within(world: &World, wanted: &str, within: Duration, note: &str) -> Duration {
    let start = Instant::now();
    wait_until(&format!("{note}: requests served by {wanted}"), within, || {
        let (worker, _) = send_ok(world, note);
        (worker == wanted).then(|| start.elapsed())
    })
}

#[test]
fn load_endpoint_faults_do_not_cost_answers() {
    // Healthy, worker_b rank 0 is the clear minimum.
    let mut world = World::start(
        "load_faults",
        2,
        &["--instant"],
        &World::base_tokens(&[&[5000, 5000, 5000, 5000], &[1000, 6000, 6000, 6000]]),
        EnvoyOptions::default(),
    );
    assert_eq!(send_ok(&world, "healthy"), ("worker_b".to_string(), 0));
    // Generous bounds: a poll must fail, then the snapshot must age out.
    let to_stale = STALE_AFTER + 4 * INTERVAL + Duration::from_secs(2);
    let to_recover = 2 * INTERVAL + Duration::from_secs(2);

    for fault in ["http_500", "malformed", "truncated", "hang"] {
        let failed_before = world.envoy.stat("poll_failed.worker_b");
        let ok_a_before = world.envoy.stat("poll_ok.worker_a");
        world.sim("worker_b").set_load_fault(fault);
        let took = routed_to_within(&world, "worker_a", to_stale, fault);
        eprintln!("{fault}: routing left worker_b after {took:?}");
        // The gauge is written at each poll round, so it may lag one interval.
        world.envoy.wait_for_stat(
            "snapshot_age_ms.worker_b",
            STALE_AFTER.as_millis() as u64 + 1,
            to_recover,
        );
        for i in 0..5 {
            let (worker, _) = send_ok(&world, &format!("{fault} {i}"));
            assert_eq!(worker, "worker_a", "{fault}: worker_b's data is stale");
        }
        assert!(
            world.envoy.stat("poll_failed.worker_b") >= failed_before + 2,
            "{fault}: failed polls of worker_b are counted"
        );
        assert!(
            world.envoy.stat("poll_ok.worker_a") >= ok_a_before + 2,
            "{fault}: worker_a is still polled"
        );

        world.sim("worker_b").set_load_fault("none");
        routed_to_within(&world, "worker_b", to_recover, &format!("{fault} recovered"));
        assert_eq!(send_ok(&world, "recovered"), ("worker_b".to_string(), 0));
    }

    // A report with more ranks than the configured dp_size: the extra (empty,
    // so least loaded) ranks are never chosen; the rest of the report is used.
    world.sim("worker_b").set_load_fault("wrong_dp_size");
    world
        .envoy
        .wait_for_stat("dp_size_mismatch.worker_b", 2, to_recover);
    for i in 0..10 {
        let served = send_ok(&world, &format!("wrong dp_size {i}"));
        assert_eq!(served, ("worker_b".to_string(), 0), "ranks 4 and 5 do not exist");
    }
    world.sim("worker_b").set_load_fault("none");

    // The worker dies. Requests sent before its data goes stale may be routed
    // to it; count what clients see then, and require success once stale.
    let failed_before = world.envoy.stat("poll_failed.worker_b");
    let routed_to_b_before = world.envoy.stat("routed.worker_b.rank_0");
    world.sims[1].kill();
    let killed = Instant::now();
    let mut window_errors = Vec::new();
    while killed.elapsed() < STALE_AFTER + 2 * INTERVAL {
        let body = json!({"text": "during", "sampling_params": {"max_new_tokens": 1}}).to_string();
        let reply = world.post("/generate", &body);
        if reply.status != 200 {
            window_errors.push(reply.status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let routed_to_dead = world.envoy.stat("routed.worker_b.rank_0") - routed_to_b_before;
    eprintln!(
        "worker down: {routed_to_dead} requests routed to it before its data went stale, errors: {window_errors:?}"
    );
    // Envoy's connect-failure retry lands them on a live worker.
    assert!(
        window_errors.is_empty(),
        "clients got errors while the dead worker's data was still fresh: {window_errors:?}"
    );
    world
        .envoy
        .wait_for_stat("poll_failed.worker_b", failed_before + 2, to_stale);
    routed_to_within(&world, "worker_a", to_stale, "worker down");
    for i in 0..5 {
        assert_eq!(send_ok(&world, &format!("down {i}")).0, "worker_a");
    }

    // No fresh data at all: requests pass through untouched and still succeed.
    world.sim("worker_a").set_load_fault("http_500");
    let passed = wait_until("passthrough.no_fresh_data", to_stale, || {
        send_ok(&world, "all stale");
        let n = world.envoy.stat("passthrough.no_fresh_data");
        (n >= 1).then_some(n)
    });
    for i in 0..4 {
        let note = format!("all stale {i}");
        let (worker, _) = send_ok(&world, &note);
        let recorded = world.sim(&worker).last_request();
        assert!(
            recorded.body_json().get("routed_dp_rank").is_none(),
            "no data: the body goes through without a rank"
        );
    }
    assert!(world.envoy.stat("passthrough.no_fresh_data") >= passed + 4);
}
