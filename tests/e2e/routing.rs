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

/// A dprank stat in Envoy's Prometheus text (`dprank_<name>`, dots as
/// underscores; the admin endpoint merges histograms): `<name>{} value`.
fn prometheus_value(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("dprank_{name}{{}} ")))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0)
}

/// Envoy's dprank histograms whose Prometheus names start with
/// `dprank_<prefix>`, by the rest of the name (`<worker>_rank_<r>`): their
/// sample counts and sums, once they have `at_least` values together; and
/// the text they were read from.
fn histograms(world: &World, prefix: &str, at_least: u64) -> (Vec<(String, u64, f64)>, String) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let text = world.envoy.admin_get("/stats/prometheus").text();
        let found: Vec<(String, u64, f64)> = text
            .lines()
            .filter_map(|l| {
                l.split_whitespace()
                    .next()?
                    .strip_prefix(&format!("dprank_{prefix}"))?
                    .strip_suffix("_count{}")
            })
            .map(|rest| {
                let name = format!("{prefix}{rest}");
                (
                    rest.to_string(),
                    prometheus_value(&text, &format!("{name}_count")) as u64,
                    prometheus_value(&text, &format!("{name}_sum")),
                )
            })
            .collect();
        let total: u64 = found.iter().map(|f| f.1).sum();
        if total >= at_least {
            return (found, text);
        }
        assert!(
            Instant::now() < deadline,
            "dprank_{prefix}*: {total} values after 15 s, {at_least} expected"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn streamed_answers_are_timed_per_rank_at_the_gateway() {
    let world = World::start(
        "delivery_timing",
        2,
        &["--time-scale", "5"],
        &World::base_tokens(&[&[9000, 9000, 9000, 9000], &[100, 100, 100, 100]]),
        EnvoyOptions::default(),
    );
    world
        .envoy
        .wait_for_stat("poll_ok.worker_b", 2, Duration::from_secs(10));
    for i in 0..6 {
        let body =
            json!({"text": format!("timed {i}"), "stream": true, "sampling_params": {"max_new_tokens": 20}})
                .to_string();
        let (status, events) = world.client.post_streaming(
            &world.envoy.url("/generate"),
            body.as_bytes(),
            |status, reader: &mut dyn std::io::BufRead| {
                let mut events = 0;
                let mut line = String::new();
                while reader.read_line(&mut line).expect("read the stream") > 0 {
                    events += usize::from(line.starts_with("data: "));
                    line.clear();
                }
                (status, events)
            },
        );
        assert_eq!((status, events > 10), (200, true), "request {i}: {events} events");
    }
    // A whole answer is not timed.
    let whole = json!({"text": "whole", "sampling_params": {"max_new_tokens": 20}}).to_string();
    assert_eq!(world.post("/generate", &whole).status, 200);

    let (ttfts, _) = histograms(&world, "delivered_ttft_ms_", 6);
    let (gaps, text) = histograms(&world, "delivered_chunk_gap_ms_", 6);
    eprintln!("delivered: TTFT {ttfts:?}, chunk gaps {gaps:?}");
    for (timed, what) in [(&ttfts, "TTFT"), (&gaps, "chunk gap")] {
        assert_eq!(
            timed.iter().map(|t| t.1).sum::<u64>(),
            6,
            "{what}: the six streamed answers, not the whole one"
        );
        for (rank, count, _) in timed.iter() {
            assert!(rank.starts_with("worker_b_rank_"), "{what} of {rank}");
            assert!(
                prometheus_value(&text, &format!("routed_{rank}")) >= *count as f64,
                "{what}: {count} answers timed on {rank}, fewer routed there"
            );
        }
    }
    let mean = |timed: &[(String, u64, f64)]| timed.iter().map(|t| t.2).sum::<f64>() / 6.0;
    let (ttft, gap) = (mean(&ttfts), mean(&gaps));
    assert!(ttft > 0.0 && ttft < 2_000.0, "TTFT {ttft} ms");
    assert!(gap > 0.0 && gap < 500.0, "gap {gap} ms");
}
