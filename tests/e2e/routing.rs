//! Requests go to the (worker, rank) holding the fewest tokens, and follow
//! the loads as they change.

use crate::common::{EnvoyOptions, World};
use serde_json::json;
use std::time::{Duration, Instant};

/// Allowance on top of "within two poll intervals" for process scheduling on
/// a shared two-core machine (the probe requests themselves take time too).
const SCHEDULING_SLACK: Duration = Duration::from_millis(300);

fn generate(world: &World, text: &str) -> (String, i64) {
    let body = json!({"text": text, "sampling_params": {"max_new_tokens": 1}}).to_string();
    let reply = world.post("/generate", &body);
    assert_eq!(reply.status, 200, "{reply:?}");
    let served = world.served_by(&reply);
    // The worker got the client's fields plus the rank it served on.
    let recorded = world.sim(&served.0).last_request();
    let mut expected = json!({"text": text, "sampling_params": {"max_new_tokens": 1}});
    expected["routed_dp_rank"] = json!(served.1);
    assert_eq!(recorded.body_json(), expected, "body received by {served:?}");
    served
}

fn lowest_pair_is_chosen_and_followed(scenario: &str) {
    let world = World::start(
        scenario,
        2,
        &["--instant"],
        &World::base_tokens(&[&[5000, 4000, 6000, 7000], &[8000, 9000, 3000, 6500]]),
        EnvoyOptions::default(),
    );
    let interval = Duration::from_millis(world.scenario.override_u64("poll_interval_ms").unwrap_or(1000));
    for i in 0..5 {
        assert_eq!(
            generate(&world, &format!("first {i}")),
            ("worker_b".to_string(), 2)
        );
    }
    assert!(world.envoy.stat("routed.worker_b.rank_2") >= 5);
    assert_eq!(world.envoy.stat("tokens.worker_b.rank_2"), 3000);

    // One worker changes, so every poll sees either the old or the new lowest pair.
    world.sim("worker_a").set_base_tokens(&[5000, 4000, 6000, 1000]);
    let changed = Instant::now();
    let deadline = 2 * interval + SCHEDULING_SLACK;
    let mut probes = 0;
    loop {
        probes += 1;
        let served = generate(&world, &format!("probe {probes}"));
        if served == ("worker_a".to_string(), 3) {
            break;
        }
        assert_eq!(
            served,
            ("worker_b".to_string(), 2),
            "until the next poll only the old lowest pair is right"
        );
        assert!(
            changed.elapsed() < deadline,
            "still routed to {served:?} {:?} after the loads changed (poll every {interval:?})",
            changed.elapsed()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "{scenario}: choice followed the loads after {:?} ({probes} probes, poll every {interval:?})",
        changed.elapsed()
    );
    for i in 0..5 {
        assert_eq!(
            generate(&world, &format!("after {i}")),
            ("worker_a".to_string(), 3)
        );
    }
}

#[test]
fn lowest_rank_is_chosen_and_followed_at_200ms() {
    lowest_pair_is_chosen_and_followed("lowest_rank");
}

#[test]
fn lowest_rank_is_followed_at_the_default_interval() {
    lowest_pair_is_chosen_and_followed("default_interval");
}

/// The shipped default, the lockstep rule (`slowest_rank_when_uncached`): a
/// worker whose slowest rank is lower wins, and within it any rank but its
/// slowest while another has room (a random tie-break sent 5 of 12 requests
/// to the slowest rank before).
#[test]
fn within_the_chosen_worker_its_slowest_rank_takes_no_request() {
    let world = World::start(
        "lockstep_rank_order",
        2,
        &["--instant"],
        &World::base_tokens(&[&[5000, 150, 3000, 4000], &[9000, 9000, 9000, 60]]),
        EnvoyOptions::default(),
    );
    for i in 0..24 {
        let (worker, rank) = generate(&world, &format!("rank order {i}"));
        assert_eq!(worker, "worker_a", "request {i}");
        assert_ne!(rank, 0, "request {i}: never worker_a's slowest rank");
    }
    assert_eq!(world.envoy.stat("routed.worker_a.rank_0"), 0);
}
