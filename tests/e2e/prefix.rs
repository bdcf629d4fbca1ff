//! Prefix affinity in a real Envoy: requests sharing a prompt prefix go to
//! the (worker, rank) that holds it, unless its load outweighs the cache.

use crate::common::{EnvoyOptions, World};
use serde_json::json;
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// Allowance on top of "within two poll intervals" for process scheduling on
/// a shared two-core machine.
const SCHEDULING_SLACK: Duration = Duration::from_millis(300);

fn system_prompt() -> String {
    "You answer questions about the tax code, briefly, citing sections. ".repeat(90)
}

/// A chat request with the shared system prompt; returns who served it.
fn chat(world: &World, question: &str) -> (String, i64) {
    let body = json!({
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": system_prompt()},
            {"role": "user", "content": question}
        ],
        "max_tokens": 1
    })
    .to_string();
    let reply = world.post("/v1/chat/completions", &body);
    assert_eq!(reply.status, 200, "{reply:?}");
    world.served_by(&reply)
}

fn start() -> World {
    World::start("prefix_affinity", 2, &["--instant"], &[], EnvoyOptions::default())
}

#[test]
fn a_shared_prefix_sticks_to_one_pair_and_distinct_prompts_spread() {
    let world = start();
    let first = chat(&world, "What is a deduction?");
    for i in 0..15 {
        assert_eq!(chat(&world, &format!("Question {i}?")), first, "request {i}");
    }
    let spread: HashSet<(String, i64)> = (0..16)
        .map(|i| {
            let text = format!("{i} is where this prompt starts, unlike any other. ").repeat(20);
            let reply = world.post(
                "/generate",
                &json!({"text": text, "sampling_params": {"max_new_tokens": 1}}).to_string(),
            );
            assert_eq!(reply.status, 200, "{reply:?}");
            world.served_by(&reply)
        })
        .collect();
    assert!(
        spread.len() >= 4,
        "distinct prompts spread over equal ranks: {spread:?}"
    );
    assert!(world.envoy.stat("shared_data_bytes") > 0);
}

#[test]
fn a_heavily_loaded_rank_loses_its_prefix_traffic_within_two_polls() {
    let world = start();
    let interval = Duration::from_millis(world.scenario.override_u64("poll_interval_ms").unwrap_or(1000));
    let warm = chat(&world, "Warm up.");
    for i in 0..4 {
        assert_eq!(chat(&world, &format!("Still warm {i}?")), warm);
    }
    let mut heavy = [0u64; 4];
    heavy[warm.1 as usize] = 2_000_000;
    world.sim(&warm.0).set_base_tokens(&heavy);
    let changed = Instant::now();
    let deadline = 2 * interval + SCHEDULING_SLACK;
    let mut probes = 0;
    let moved = loop {
        probes += 1;
        let served = chat(&world, &format!("Probe {probes}?"));
        if served != warm {
            break served;
        }
        assert!(
            changed.elapsed() < deadline,
            "still on the loaded {warm:?} {:?} after its load rose (poll every {interval:?})",
            changed.elapsed()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    eprintln!(
        "the prefix left the loaded rank after {:?} ({probes} probes, poll every {interval:?})",
        changed.elapsed()
    );
    for i in 0..5 {
        assert_eq!(
            chat(&world, &format!("After {i}?")),
            moved,
            "sticks where it went"
        );
    }
}
