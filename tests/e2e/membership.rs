//! Workers taken from the cluster (`envoy/cluster-discovery.yaml`): dprank
//! reads the `sglang` cluster's hosts from Envoy's admin API at every poll
//! round. The cluster is fed by file-based EDS from a test-private copy of
//! `envoy/eds/sglang.yaml`, replaced atomically to add and remove workers.

use crate::common::lifecycle::{render_discovery, write_eds};
use crate::common::process::{free_port, EnvoyProcess, Launch};
use crate::common::{start_sims, wait_until, Client, Scenario, Sim, TestDir};
use serde_json::json;
use std::time::{Duration, Instant};

/// The stat name dprank gives a discovered worker (its address, punctuation as `_`).
fn stat_name(sim: &Sim) -> String {
    sim.addr
        .to_string()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// Sends one request; it must succeed. Returns (worker name, rank).
fn send(client: &Client, envoy: &EnvoyProcess, sims: &[Sim], note: &str) -> (String, i64) {
    let body = json!({"text": note, "sampling_params": {"max_new_tokens": 1}}).to_string();
    let reply = client.post(
        &envoy.url("/generate"),
        &[("content-type", "application/json")],
        body.as_bytes(),
    );
    assert_eq!(reply.status, 200, "{note}: {reply:?}");
    let addr = reply.header("x-sim-worker").expect("x-sim-worker");
    let sim = sims
        .iter()
        .find(|s| s.addr.to_string() == addr)
        .unwrap_or_else(|| panic!("{addr} is none of the workers"));
    (sim.name.clone(), reply.rank())
}

#[test]
fn workers_follow_the_cluster_membership() {
    follow_the_cluster_membership("membership");
}

/// The same, the routing threads reading states through the change log.
#[test]
fn workers_follow_the_cluster_membership_with_the_change_log() {
    follow_the_cluster_membership("membership_change_log");
}

fn follow_the_cluster_membership(name: &str) {
    let scenario = Scenario::load(name);
    let interval = Duration::from_millis(scenario.override_u64("poll_interval_ms").expect("set"));
    let dir = TestDir::new(&scenario.name);
    let sims = start_sims(&dir, 3, &["--instant"]);
    // worker_b rank 2 is the lowest of the first two; worker_c is lower still.
    sims[0].set_base_tokens(&[5000, 4000, 6000, 7000]);
    sims[1].set_base_tokens(&[8000, 9000, 3000, 6500]);
    sims[2].set_base_tokens(&[900, 100, 900, 900]);
    let (a, b, c) = (&sims[0], &sims[1], &sims[2]);
    let eds = dir.file("eds-sglang.yaml");
    write_eds(&eds, &[a, b]);
    let config = dir.file("envoy.yaml");
    std::fs::write(
        &config,
        render_discovery(free_port(), &eds, &scenario.filter_overrides),
    )
    .expect("write the config");
    let envoy = EnvoyProcess::start(&dir, &config, &Launch::new("envoy"));
    let client = Client::new();
    let slow = Duration::from_secs(10);
    for sim in [a, b] {
        envoy.wait_for_stat(&format!("poll_ok.{}", stat_name(sim)), 1, slow);
    }
    let first_changes = envoy.stat("membership_changes");
    assert!(first_changes >= 1, "the first membership read is a change");

    // Only the two listed workers: traffic, polls.
    for i in 0..10 {
        assert_eq!(
            send(&client, &envoy, &sims, &format!("two {i}")),
            ("worker_b".into(), 2)
        );
    }
    assert!(c.requests().is_empty(), "worker_c is not in the cluster");
    assert_eq!(c.load_requests("/v1/loads"), 0, "worker_c is not polled");

    // Added to the EDS file: polled, then chosen (it is the least loaded).
    write_eds(&eds, &[a, b, c]);
    let added = Instant::now();
    wait_until("requests served by worker_c", slow, || {
        (send(&client, &envoy, &sims, "added").0 == "worker_c").then_some(())
    });
    let took = added.elapsed();
    eprintln!("membership: worker_c added, chosen after {took:?} (poll every {interval:?})");
    assert!(
        took < 5 * interval + Duration::from_secs(1),
        "worker_c took {took:?}"
    );
    for i in 0..5 {
        assert_eq!(
            send(&client, &envoy, &sims, &format!("three {i}")),
            ("worker_c".into(), 1)
        );
    }
    assert_eq!(envoy.stat("membership_changes"), first_changes + 1);
    assert!(envoy.stat(&format!("poll_ok.{}", stat_name(c))) >= 1);

    // Removed: no more traffic, no more polls (its state is dropped).
    write_eds(&eds, &[a, b]);
    let removed = Instant::now();
    envoy.wait_for_stat("membership_changes", first_changes + 2, slow);
    eprintln!("membership: worker_c removal seen after {:?}", removed.elapsed());
    // A poll dispatched in the round that read the change may still arrive.
    std::thread::sleep(interval + Duration::from_millis(100));
    let c_polls = c.load_requests("/v1/loads");
    let c_served = c.requests().len();
    let ab_polls: Vec<u64> = [a, b].iter().map(|s| s.load_requests("/v1/loads")).collect();
    let quiet = Instant::now();
    for i in 0..10 {
        assert_eq!(
            send(&client, &envoy, &sims, &format!("gone {i}")),
            ("worker_b".into(), 2)
        );
    }
    std::thread::sleep((5 * interval).saturating_sub(quiet.elapsed()));
    assert_eq!(c.requests().len(), c_served, "no traffic to a removed worker");
    assert_eq!(
        c.load_requests("/v1/loads"),
        c_polls,
        "no polls of a removed worker over {:?}",
        quiet.elapsed()
    );
    for (sim, before) in [a, b].iter().zip(ab_polls) {
        assert!(
            sim.load_requests("/v1/loads") >= before + 3,
            "{} is still polled",
            sim.name
        );
    }
    assert_eq!(envoy.stat("membership_failed"), 0);
}
