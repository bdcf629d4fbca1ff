//! Clients that go away at every point of a request's life, in a real
//! Envoy: while its PD prefill leg is in flight, mid-stream, right after its
//! headers, and with a body that never ends (a client leaving while
//! admission holds it: `admission.rs`). The filter neither panics nor
//! reloads, a request is routed (and counted) at most once, a client's
//! leaving counts against no worker's health, and the next requests are
//! served as before.

use crate::common::pd::PdWorld;
use crate::common::process::EnvoyProcess;
use crate::common::{wait_until, EnvoyOptions, World};
use serde_json::json;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Lines of Envoy's log that say a VM failed.
fn vm_failures(envoy: &EnvoyProcess) -> Vec<String> {
    std::fs::read_to_string(envoy.log_path())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("panicked") || l.contains("RuntimeError") || l.contains("Function: proxy_on"))
        .map(str::to_string)
        .collect()
}

/// Requests routed to any (worker, rank), by the filter's counters.
fn routed(envoy: &EnvoyProcess) -> u64 {
    envoy.stats_matching("dprank.routed.").values().sum()
}

/// Opens a connection and sends a request head (and `body`, which may be
/// shorter than `content_length`).
fn start_request(addr: SocketAddr, path: &str, content_length: usize, body: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("connect to Envoy");
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {content_length}\r\n\r\n"
    )
    .expect("send the head");
    stream.write_all(body).expect("send the body");
    stream.flush().expect("flush");
    stream
}

fn long_prompt(words: usize) -> String {
    (0..words).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ")
}

#[test]
fn a_client_gone_mid_stream_after_its_headers_or_mid_body_costs_nothing() {
    let world = World::start(
        "client_faults",
        2,
        &["--time-scale", "5"],
        &World::base_tokens(&[&[5000, 5000, 5000, 5000], &[1000, 6000, 6000, 6000]]),
        EnvoyOptions::default(),
    );
    let addr = world.envoy.listener;

    // Mid-stream: the first event read, then the connection dropped.
    let before = routed(&world.envoy);
    let body = json!({"text": long_prompt(200), "sampling_params": {"max_new_tokens": 400}, "stream": true})
        .to_string();
    let stream = start_request(addr, "/generate", body.len(), body.as_bytes());
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut line = String::new();
    wait_until("the first streamed event", Duration::from_secs(10), || {
        line.clear();
        reader.read_line(&mut line).ok()?;
        line.starts_with("data:").then_some(())
    });
    drop(reader);
    drop(stream);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(routed(&world.envoy), before + 1, "mid-stream: routed once");

    // Right after its headers: the body never sent.
    let before = routed(&world.envoy);
    let served_before: usize = world.sims.iter().map(|s| s.requests().len()).sum();
    drop(start_request(addr, "/generate", 5000, b""));
    // Mid-body: a tenth of the body, a pause, then gone.
    let partial = start_request(addr, "/generate", 5000, &[b' '; 500]);
    std::thread::sleep(Duration::from_millis(1000));
    drop(partial);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        routed(&world.envoy),
        before,
        "a request without its whole body is never routed"
    );
    let served: usize = world.sims.iter().map(|s| s.requests().len()).sum();
    assert_eq!(served, served_before, "nor forwarded");

    // Nobody's health suffered, and the next requests are served as before.
    for w in ["worker_a", "worker_b"] {
        assert_eq!(
            world.envoy.stat(&format!("failures.{w}")),
            0,
            "{w}: a client leaving is no failure of it"
        );
    }
    for i in 0..5 {
        let reply = world.post(
            "/generate",
            &json!({"text": format!("after {i}"), "sampling_params": {"max_new_tokens": 1}}).to_string(),
        );
        assert_eq!(reply.status, 200, "{reply:?}");
    }
    let failures = vm_failures(&world.envoy);
    assert!(failures.is_empty(), "the VM failed:\n{}", failures.join("\n"));
}

#[test]
fn a_client_gone_while_its_prefill_leg_is_in_flight_costs_nothing() {
    let loads: [&[u64]; 4] = [
        &[3000, 5000],
        &[4000, 1000],
        &[5000, 6000, 1500, 7000],
        &[4000, 3000, 5000, 6000],
    ];
    let world = PdWorld::start("client_faults_pd", 2, 4, &["--time-scale", "5"], &loads);
    let prefill_b = world.prefill_sim("prefill_b");
    prefill_b.control(json!({"response_delay_ms": 800}));
    let counted =
        |w: &PdWorld| w.envoy.stat("prefill_ok.prefill_b") + w.envoy.stat("prefill_failed.prefill_b");
    let before = counted(&world);
    let legs_before = prefill_b.requests().len();
    let body = json!({"text": long_prompt(2000), "sampling_params": {"max_new_tokens": 1}}).to_string();
    let stream = start_request(world.envoy.listener, "/generate", body.len(), body.as_bytes());
    wait_until("the prefill leg at prefill_b", Duration::from_secs(5), || {
        (prefill_b.requests().len() > legs_before).then_some(())
    });
    drop(stream);
    // The leg answers 800 ms later, to nobody.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        counted(&world) <= before + 1,
        "the leg's end is counted at most once"
    );
    assert_eq!(
        world.envoy.stat("failures.prefill_b"),
        0,
        "a client leaving is no failure of prefill_b"
    );
    prefill_b.control(json!({"response_delay_ms": 0}));
    // Its estimate went back: prefill_b rank 1 is the lowest again.
    wait_until("prefill_b rank 1 chosen again", Duration::from_secs(5), || {
        let trace = world.exchange("/generate", &json!({"text": "next"}).to_string());
        (trace.prefill == ("prefill_b".to_string(), 1)).then_some(())
    });
    let failures = vm_failures(&world.envoy);
    assert!(failures.is_empty(), "the VM failed:\n{}", failures.join("\n"));
}
