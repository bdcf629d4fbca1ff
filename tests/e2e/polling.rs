//! Polling cadence: one poller per Envoy process, whatever its thread count;
//! the endpoint fallback; and that every shipped config validates.

use crate::common::{envoy_bin, repo_root, wait_until, wasm_path, EnvoyOptions, TestDir, World};
use serde_json::json;
use std::process::Command;
use std::time::{Duration, Instant};

const INTERVAL_MS: f64 = 200.0;

fn polls_once_per_interval(concurrency: u32) {
    let world = World::start(
        "poll_cadence",
        2,
        &["--instant"],
        &[],
        EnvoyOptions {
            concurrency,
            ..EnvoyOptions::default()
        },
    );
    let count = |w: &World| -> Vec<u64> { w.sims.iter().map(|s| s.load_requests("/v1/loads")).collect() };
    let before = count(&world);
    let start = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    let after = count(&world);
    let elapsed_ms = start.elapsed().as_secs_f64() * 1000.0;
    let expected = elapsed_ms / INTERVAL_MS;
    for ((sim, b), a) in world.sims.iter().zip(&before).zip(&after) {
        let polls = (a - b) as f64;
        eprintln!(
            "--concurrency {concurrency}: {} polled {polls} times in {elapsed_ms:.0} ms (expected {expected:.1})",
            sim.name
        );
        assert!(
            (0.7 * expected..=1.3 * expected).contains(&polls),
            "{}: {polls} polls in {elapsed_ms:.0} ms with --concurrency {concurrency}; \
             one per {INTERVAL_MS} ms means {expected:.1}",
            sim.name
        );
        assert_eq!(sim.load_requests("/get_load"), 0, "auto uses /v1/loads");
    }
}

#[test]
fn one_poll_per_interval_with_two_threads() {
    polls_once_per_interval(2);
}

#[test]
fn one_poll_per_interval_with_four_threads() {
    polls_once_per_interval(4);
}

#[test]
fn auto_endpoint_falls_back_to_get_load() {
    let world = World::start(
        "poll_cadence",
        2,
        &["--instant", "--no-v1-loads"],
        &World::base_tokens(&[&[900, 900, 900, 900], &[900, 900, 100, 900]]),
        EnvoyOptions::default(),
    );
    // Routing works on /get_load data.
    let reply = world.post("/generate", &json!({"text": "fallback"}).to_string());
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(world.served_by(&reply), ("worker_b".to_string(), 2));
    // /v1/loads was tried once (404), then /get_load only.
    let v1 = |w: &World| -> Vec<u64> { w.sims.iter().map(|s| s.load_requests("/v1/loads")).collect() };
    let tried = v1(&world);
    let get_load_before: u64 = world.sims.iter().map(|s| s.load_requests("/get_load")).sum();
    let more_polls = get_load_before + 2 * 5;
    wait_until(
        "five more /get_load polls per worker",
        Duration::from_secs(10),
        || {
            let n: u64 = world.sims.iter().map(|s| s.load_requests("/get_load")).sum();
            (n >= more_polls).then_some(())
        },
    );
    assert_eq!(v1(&world), tried, "/v1/loads is not asked again");
    for (sim, n) in world.sims.iter().zip(&tried) {
        assert!(
            (1..=2).contains(n),
            "{}: /v1/loads asked {n} times before falling back",
            sim.name
        );
        assert_eq!(world.envoy.stat(&format!("poll_failed.{}", sim.name)), 0);
    }
}

/// `envoy --mode validate` accepts every config in envoy/ (the wasm path,
/// relative to the repo root there, made absolute).
#[test]
fn every_shipped_envoy_config_validates() {
    let dir = TestDir::new("validate");
    let wasm = wasm_path();
    let mut configs: Vec<_> = std::fs::read_dir(repo_root().join("envoy"))
        .expect("read envoy/")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    configs.sort();
    assert!(!configs.is_empty(), "no YAML in envoy/");
    for config in configs {
        let name = config.file_name().unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(&config).expect("read config");
        let rendered = dir.file(&name);
        std::fs::write(
            &rendered,
            text.replace(
                "target/wasm32-wasip1/release/dprank.wasm",
                &wasm.display().to_string(),
            ),
        )
        .expect("write config");
        let output = Command::new(envoy_bin())
            .args([
                "--mode",
                "validate",
                "--disable-hot-restart",
                "-l",
                "warning",
                "-c",
            ])
            .arg(&rendered)
            .current_dir(repo_root())
            .output()
            .expect("run envoy --mode validate");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && stdout.contains("OK"),
            "envoy/{name} does not validate ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
