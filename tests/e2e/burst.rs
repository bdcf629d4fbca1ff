//! Between two polls, a burst of concurrent requests is spread by the
//! filter's own estimates of what it sent, not piled onto the stale minimum.

use crate::common::{Client, EnvoyOptions, World};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::{Arc, Barrier};

const REQUESTS: usize = 200;
/// Every response is held this long, so the whole burst is in flight at once.
const RESPONSE_DELAY_MS: u64 = 4000;

/// Prompt sizes 100 B .. 20 KB from a fixed LCG, so runs are comparable.
fn prompt_sizes() -> Vec<usize> {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    (0..REQUESTS)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            100 + ((state >> 33) % 19_901) as usize
        })
        .collect()
}

/// Sends the burst; returns the estimated tokens (ceil(prompt bytes / 4), the
/// filter's estimate) each (worker, rank) received, from the workers' records.
fn burst(world: &World) -> BTreeMap<(String, u64), u64> {
    for sim in &world.sims {
        sim.control(json!({ "response_delay_ms": RESPONSE_DELAY_MS }));
    }
    let polls = || world.envoy.stat("poll_ok.worker_a") + world.envoy.stat("poll_ok.worker_b");
    let polls_before = polls();
    assert!(
        world.envoy.stat("poll_ok.worker_a") >= 1 && world.envoy.stat("poll_ok.worker_b") >= 1,
        "each worker polled before the burst"
    );
    let url = world.envoy.url("/generate");
    let start = Arc::new(Barrier::new(REQUESTS));
    let threads: Vec<_> = prompt_sizes()
        .into_iter()
        .enumerate()
        .map(|(i, size)| {
            let url = url.clone();
            let start = start.clone();
            std::thread::spawn(move || {
                // A distinct start per request: no two prompts share a prefix, so
                // prefix affinity (on in `burst_spread`) has nothing to keep together.
                let text: String = format!("{i:03}:")
                    .chars()
                    .chain((4..size).map(|j| (b'a' + ((i + j) % 26) as u8) as char))
                    .collect();
                let body = json!({"text": text, "sampling_params": {"max_new_tokens": 1}});
                let client = Client::new();
                start.wait();
                client.post(
                    &url,
                    &[("content-type", "application/json")],
                    body.to_string().as_bytes(),
                )
            })
        })
        .collect();
    for thread in threads {
        let reply = thread.join().expect("request thread");
        assert_eq!(reply.status, 200, "{reply:?}");
    }
    assert_eq!(polls(), polls_before, "no poll may happen during the burst");
    let mut sent: BTreeMap<(String, u64), u64> = BTreeMap::new();
    for sim in &world.sims {
        for rank in 0..4 {
            sent.insert((sim.name.clone(), rank), 0);
        }
        for request in sim.requests() {
            let body = request.body_json();
            let rank = request.rank.expect("served on a rank");
            assert_eq!(body["routed_dp_rank"], json!(rank), "the filter chose the rank");
            let text = body["text"].as_str().expect("text");
            *sent.entry((sim.name.clone(), rank)).or_default() += (text.len() as u64).div_ceil(4);
        }
    }
    let total: u64 = sent.values().sum();
    let expected: u64 = prompt_sizes().iter().map(|s| (*s as u64).div_ceil(4)).sum();
    assert_eq!(total, expected, "every request reached a worker once");
    sent
}

#[test]
fn a_burst_between_polls_spreads_over_all_ranks() {
    spreads_over_all_ranks("burst_spread");
}

/// The same, each thread learning the other's estimates from the change log.
#[test]
fn a_burst_spreads_with_the_change_log() {
    spreads_over_all_ranks("burst_spread_change_log");
}

fn spreads_over_all_ranks(scenario: &str) {
    let world = World::start(scenario, 2, &["--instant"], &[], EnvoyOptions::default());
    let sent = burst(&world);
    let mean = sent.values().sum::<u64>() as f64 / sent.len() as f64;
    eprintln!("burst, equal loads: tokens per rank {sent:?}, mean {mean:.0}");
    for (pair, tokens) in &sent {
        let ratio = *tokens as f64 / mean;
        assert!(
            (0.75..=1.25).contains(&ratio),
            "{pair:?} got {tokens} tokens, {ratio:.2} x the mean {mean:.0}: {sent:?}"
        );
    }
}

#[test]
fn a_burst_fills_the_less_loaded_ranks_first() {
    fills_the_less_loaded_ranks_first("burst_levels");
}

/// The same, estimates and releases travelling between threads through the change log.
#[test]
fn a_burst_fills_the_less_loaded_ranks_first_with_the_change_log() {
    fills_the_less_loaded_ranks_first("burst_levels_change_log");
}

fn fills_the_less_loaded_ranks_first(scenario: &str) {
    let base_a = [0, 10_000, 20_000, 30_000];
    let base_b = [40_000, 0, 20_000, 10_000];
    let world = World::start(
        scenario,
        2,
        &["--instant"],
        &World::base_tokens(&[&base_a, &base_b]),
        EnvoyOptions::default(),
    );
    let sent = burst(&world);
    let base: BTreeMap<(String, u64), u64> = base_a
        .iter()
        .enumerate()
        .map(|(r, b)| (("worker_a".to_string(), r as u64), *b))
        .chain(
            base_b
                .iter()
                .enumerate()
                .map(|(r, b)| (("worker_b".to_string(), r as u64), *b)),
        )
        .collect();
    eprintln!("burst, unequal loads: base {base:?}, sent {sent:?}");
    // A rank with 20k+ fewer tokens at the poll must receive more of the burst.
    for (pair, b) in &base {
        for (other, ob) in &base {
            if b + 20_000 <= *ob {
                assert!(
                    sent[pair] > sent[other],
                    "{pair:?} (base {b}) got {} tokens, {other:?} (base {ob}) got {}",
                    sent[pair],
                    sent[other]
                );
            }
        }
    }
    // Once the burst has ended its estimates are dropped (no poll has covered
    // them): the next requests see the polled loads again, whose minimum is 0.
    for sim in &world.sims {
        sim.control(json!({ "response_delay_ms": 0 }));
    }
    for i in 0..4 {
        let reply = world.post("/generate", &json!({"text": format!("after {i}")}).to_string());
        let served = world.served_by(&reply);
        assert!(
            base[&(served.0.clone(), served.1 as u64)] == 0,
            "after the burst, request {i} went to {served:?}: are ended requests' estimates kept?"
        );
    }

    // The burst evens the totals out: base + sent ends about level.
    let levels: Vec<u64> = base.keys().map(|k| base[k] + sent[k]).collect();
    let mean = levels.iter().sum::<u64>() as f64 / levels.len() as f64;
    for (pair, level) in base.keys().zip(&levels) {
        let ratio = *level as f64 / mean;
        assert!(
            (0.8..=1.2).contains(&ratio),
            "{pair:?} ends at {level} tokens, {ratio:.2} x the mean {mean:.0}: levels {levels:?}"
        );
    }
}
