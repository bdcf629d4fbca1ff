//! Admission control (overload protection) in a real Envoy: refusals, held
//! requests let in or timed out, a full queue, clients leaving while held,
//! classes and tenants, header mode, PD mode, a reload while a request is
//! held, the request cap per rank, and SLO admission learning a limit.
//! Saturation is made deterministic by the scenarios: a rank drains 1
//! token/s and may hold 1 ms of wait, so a rank is saturated exactly while
//! one of this gateway's streamed requests on it has no first byte yet;
//! the simulated workers hold their answers back (`response_delay_ms`).

use crate::common::lifecycle::{lds_listener_with, render_with_lds, write_lds};
use crate::common::pd::PdWorld;
use crate::common::process::{free_port, EnvoyProcess, Launch};
use crate::common::{
    repo_root, start_sims, wait_until, Client, Envoy, EnvoyOptions, Reply, Scenario, Sim, TestDir, World,
};
use serde_json::{json, Value};
use std::io::Write;
use std::net::TcpStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A streamed `/generate` body tagged `tag`.
fn body(tag: &str) -> String {
    json!({"text": format!("{tag} hello"), "stream": true, "sampling_params": {"max_new_tokens": 2}})
        .to_string()
}

/// Sends a streamed request from a thread: its reply and how long it took.
fn send(url: String, tag: &str, headers: Vec<(String, String)>) -> JoinHandle<(Reply, Duration)> {
    let body = body(tag);
    std::thread::spawn(move || {
        let mut all: Vec<(&str, &str)> = vec![("content-type", "application/json")];
        all.extend(headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let started = Instant::now();
        let reply = Client::new().post(&url, &all, body.as_bytes());
        (reply, started.elapsed())
    })
}

/// Every worker holds its answers back `ms`.
fn delay(sims: &[Sim], ms: u64) {
    for sim in sims {
        sim.control(json!({ "response_delay_ms": ms }));
    }
}

/// Fills every one of the 8 ranks with a request held back by the workers:
/// returns once the filter has let all 8 in.
fn fill(world: &World, tag: &str) -> Vec<JoinHandle<(Reply, Duration)>> {
    fill_ranks(&world.envoy, 8, tag)
}

/// Sends `n` requests held back by the workers one after the other, each
/// once the filter let the one before in (two at once on two Envoy
/// threads could both find the same empty rank before either's estimate
/// is written).
fn fill_ranks(envoy: &EnvoyProcess, n: u64, tag: &str) -> Vec<JoinHandle<(Reply, Duration)>> {
    let before = envoy.stat("admission.admitted.standard");
    let url = envoy.url("/generate");
    (0..n)
        .map(|i| {
            let handle = send(url.clone(), &format!("{tag}{i}"), Vec::new());
            envoy.wait_for_stat(
                "admission.admitted.standard",
                before + i + 1,
                Duration::from_secs(10),
            );
            handle
        })
        .collect()
}

fn served(world_sims: &[Sim]) -> usize {
    world_sims.iter().map(|s| s.requests().len()).sum()
}

fn assert_ok(handles: Vec<JoinHandle<(Reply, Duration)>>) {
    for h in handles {
        let (reply, _) = h.join().expect("request thread");
        assert_eq!(reply.status, 200, "{reply:?}");
    }
}

#[test]
fn admission_refuses_with_429_and_retry_after_while_every_rank_is_busy() {
    let world = World::start(
        "admission_reject",
        2,
        &["--instant"],
        &[],
        EnvoyOptions::default(),
    );
    delay(&world.sims, 1500);
    let busy = fill(&world, "busy");
    let started = Instant::now();
    let reply = world.post("/generate", &body("refused"));
    let took = started.elapsed();
    assert_eq!(reply.status, 429, "{reply:?}");
    let retry: u64 = reply
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no retry-after: {reply:?}"));
    assert!(retry >= 1, "{reply:?}");
    assert_eq!(reply.header("x-dprank-admission"), Some("saturated"));
    assert_eq!(reply.header("x-envoy-ratelimited"), Some("true"));
    assert_eq!(reply.json()["error"]["type"], "overloaded");
    eprintln!("admission: refused in {took:?}, retry-after {retry} s");
    assert!(took < Duration::from_millis(500), "refused at once: {took:?}");
    assert_eq!(world.envoy.stat("rejected.saturated"), 1);
    assert_eq!(world.envoy.stat("admission.rejected.saturated.standard"), 1);
    assert_ok(busy);
    assert_eq!(served(&world.sims), 8, "the refused request reached no worker");
    let after = world.post("/generate", &body("after"));
    assert_eq!(after.status, 200, "room again: {after:?}");
}

#[test]
fn a_held_request_is_let_in_once_a_rank_has_room() {
    let world = World::start("admission_queue", 2, &["--instant"], &[], EnvoyOptions::default());
    delay(&world.sims, 1000);
    let busy = fill(&world, "busy");
    let filled = Instant::now();
    let held = send(world.envoy.url("/generate"), "held", Vec::new());
    world
        .envoy
        .wait_for_stat("admission.queued.standard", 1, Duration::from_secs(5));
    let (reply, took) = held.join().expect("held request");
    assert_eq!(reply.status, 200, "{reply:?}");
    let waited = filled.elapsed();
    eprintln!("admission: the held request answered after {took:?} ({waited:?} after the ranks filled)");
    assert!(
        took >= Duration::from_millis(800),
        "it waited for a rank: {took:?}"
    );
    assert_ok(busy);
    assert_eq!(served(&world.sims), 9, "forwarded once");
    let tagged = world
        .sims
        .iter()
        .flat_map(|s| s.requests())
        .filter(|r| r.body_text().contains("held hello"))
        .count();
    assert_eq!(tagged, 1);
    assert_eq!(world.envoy.stat("admission.admitted.standard"), 9);
    wait_until("the held gauge at 0", Duration::from_secs(2), || {
        (world.envoy.stat("admission.held") == 0).then_some(())
    });
}

#[test]
fn a_client_that_leaves_while_held_frees_its_place_and_is_never_forwarded() {
    let world = World::start("admission_queue", 2, &["--instant"], &[], EnvoyOptions::default());
    delay(&world.sims, 1500);
    let busy = fill(&world, "busy");
    let addr = world.envoy.listener;
    let text = body("gone");
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{text}",
        text.len()
    )
    .expect("send");
    world
        .envoy
        .wait_for_stat("admission.queued.standard", 1, Duration::from_secs(5));
    drop(stream);
    world
        .envoy
        .wait_for_stat("admission.client_gone.standard", 1, Duration::from_secs(5));
    wait_until("the held gauge at 0", Duration::from_secs(2), || {
        (world.envoy.stat("admission.held") == 0).then_some(())
    });
    assert_ok(busy);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        served(&world.sims),
        8,
        "the request that left was never forwarded"
    );
    assert_eq!(world.envoy.stat("admission.admitted.standard"), 8);
    let next = world.post("/generate", &body("next"));
    assert_eq!(next.status, 200, "the next request still routes: {next:?}");
    assert_eq!(served(&world.sims), 9);
    assert_eq!(world.envoy.stat("admission.admitted.standard"), 9);
}

#[test]
fn a_full_queue_refuses_at_once_and_the_held_request_keeps_its_place() {
    let world = World::start("admission_full", 2, &["--instant"], &[], EnvoyOptions::default());
    delay(&world.sims, 1500);
    let busy = fill(&world, "busy");
    let held = send(world.envoy.url("/generate"), "held", Vec::new());
    world
        .envoy
        .wait_for_stat("admission.queued.standard", 1, Duration::from_secs(5));
    let started = Instant::now();
    let full = world.post("/generate", &body("full"));
    let took = started.elapsed();
    assert_eq!(full.status, 429, "{full:?}");
    assert_eq!(full.header("x-dprank-admission"), Some("queue_full"));
    assert_eq!(full.header("x-envoy-ratelimited"), Some("true"));
    assert!(
        full.header("retry-after")
            .is_some_and(|v| v.parse::<u64>().is_ok_and(|s| s >= 1)),
        "{full:?}"
    );
    assert!(took < Duration::from_millis(500), "refused at once: {took:?}");
    let shed = Client::new().post(
        &world.envoy.url("/generate"),
        &[
            ("content-type", "application/json"),
            ("x-dprank-priority", "sheddable"),
        ],
        body("shed").as_bytes(),
    );
    assert_eq!(shed.status, 429, "{shed:?}");
    assert_eq!(shed.header("x-dprank-admission"), Some("sheddable"));
    assert_eq!(world.envoy.stat("admission.rejected.queue_full.standard"), 1);
    assert_eq!(world.envoy.stat("admission.rejected.sheddable.sheddable"), 1);
    let (reply, _) = held.join().expect("held request");
    assert_eq!(reply.status, 200, "the held request kept its place: {reply:?}");
    assert_ok(busy);
    let tags: Vec<String> = world
        .sims
        .iter()
        .flat_map(|s| s.requests())
        .map(|r| r.body_text().to_string())
        .collect();
    assert_eq!(tags.len(), 9, "the eight and the held one");
    assert!(!tags
        .iter()
        .any(|t| t.contains("full hello") || t.contains("shed hello")));
    wait_until("the held gauge at 0", Duration::from_secs(2), || {
        (world.envoy.stat("admission.held") == 0).then_some(())
    });
}

#[test]
fn a_request_held_to_its_time_out_gets_503_at_the_last_tick_before() {
    let world = World::start(
        "admission_timeout",
        2,
        &["--instant"],
        &[],
        EnvoyOptions::default(),
    );
    delay(&world.sims, 3000);
    let busy = fill(&world, "busy");
    let (reply, took) = send(world.envoy.url("/generate"), "late", Vec::new())
        .join()
        .expect("held request");
    assert_eq!(reply.status, 503, "{reply:?}");
    assert_eq!(reply.header("x-dprank-admission"), Some("queue_timeout"));
    assert_eq!(reply.header("x-envoy-overloaded"), Some("true"));
    assert!(reply
        .header("retry-after")
        .is_some_and(|v| v.parse::<u64>().is_ok()));
    eprintln!("admission: timed out after {took:?} (queue_timeout_ms 400, tick 50 ms)");
    assert!(
        // Answered at the last tick before the time-out (ticks every 50 ms);
        // the upper bound leaves a busy machine 300 ms.
        took >= Duration::from_millis(400 - 50) && took < Duration::from_millis(400 + 300),
        "{took:?}"
    );
    assert_eq!(world.envoy.stat("admission.rejected.queue_timeout.standard"), 1);
    assert_ok(busy);
    assert_eq!(served(&world.sims), 8);
}

#[test]
fn held_requests_go_highest_class_first_then_tenants_in_turn() {
    let scenario = Scenario::load("admission_order");
    let dir = TestDir::new(&scenario.name);
    let sims = vec![Sim::start(&dir, "worker_a", 1, &["--instant"])];
    let options = EnvoyOptions {
        concurrency: 1,
        ..EnvoyOptions::default()
    };
    let envoy = Envoy::start(&dir, &scenario, &sims, &options);
    envoy.wait_for_stat("poll_ok.worker_a", 1, Duration::from_secs(10));
    delay(&sims, 400);
    let url = envoy.url("/generate");
    let first = send(url.clone(), "first", Vec::new());
    envoy.wait_for_stat("admission.admitted.standard", 1, Duration::from_secs(5));
    let held = [
        ("s-a1", "standard", "a"),
        ("s-a2", "standard", "a"),
        ("s-b1", "standard", "b"),
        ("c-z1", "critical", "z"),
        ("s-c1", "standard", "c"),
    ];
    let mut handles = vec![first];
    for (i, (tag, class, tenant)) in held.iter().enumerate() {
        let headers = vec![
            ("x-dprank-priority".to_string(), class.to_string()),
            ("x-tenant".to_string(), tenant.to_string()),
        ];
        handles.push(send(url.clone(), tag, headers));
        wait_until(&format!("{tag} held"), Duration::from_secs(5), || {
            let queued = envoy.stat("admission.queued.standard") + envoy.stat("admission.queued.critical");
            (queued > i as u64).then_some(())
        });
    }
    assert_ok(handles);
    let order: Vec<String> = sims[0]
        .requests()
        .iter()
        .map(|r| r.body_json()["text"].as_str().unwrap_or("").replace(" hello", ""))
        .collect();
    assert_eq!(order, ["first", "c-z1", "s-a1", "s-b1", "s-c1", "s-a2"]);
}

#[test]
fn header_mode_holds_a_request_with_its_body_and_lets_it_in() {
    let world = World::start(
        "admission_header",
        2,
        &["--instant"],
        &[],
        EnvoyOptions::default(),
    );
    delay(&world.sims, 1000);
    let busy = fill(&world, "busy");
    let (reply, took) = send(world.envoy.url("/generate"), "held", Vec::new())
        .join()
        .expect("held request");
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(took >= Duration::from_millis(700), "{took:?}");
    assert_eq!(world.envoy.stat("admission.queued.standard"), 1);
    assert_ok(busy);
    let held = world
        .sims
        .iter()
        .flat_map(|s| s.requests())
        .find(|r| r.body_text().contains("held hello"))
        .expect("the held request reached a worker");
    assert_eq!(held.body_text(), body("held"), "its body untouched");
    assert!(held.header("x-data-parallel-rank").is_some(), "{held:?}");
}

#[test]
fn pd_mode_judges_the_prefill_pool_and_the_root_carries_the_prefill_leg() {
    let world = PdWorld::start("admission_pd", 1, 1, &["--instant"], &[]);
    // Instant workers prefill at once: the prefill leg's answer and the
    // decode's first byte (either ends a request's prefill) come late.
    for sim in world.prefill.iter().chain(&world.decode) {
        sim.control(json!({ "response_delay_ms": 1000 }));
    }
    let url = world.envoy.url("/generate");
    let busy = fill_ranks(&world.envoy, 2, "busy");
    let (reply, took) = send(url, "held", Vec::new()).join().expect("held request");
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(
        world.envoy.stat("admission.queued.standard"),
        1,
        "{:?}",
        world.envoy.stats()
    );
    eprintln!("admission: the held PD request answered after {took:?}");
    assert!(took >= Duration::from_millis(700), "{took:?}");
    assert_ok(busy);
    let prefilled: usize = world.prefill.iter().map(|s| s.requests().len()).sum();
    assert_eq!(prefilled, 3, "one prefill leg each");
}

/// The filter's configuration replaced, then the listeners drained, while
/// a request is held.
#[test]
fn a_request_held_across_a_reload_or_a_drain_times_out_on_time() {
    let scenario = Scenario::load("admission_reload");
    let dir = TestDir::new(&scenario.name);
    let sims = start_sims(&dir, 2, &["--instant"]);
    let lds = dir.file("lds.yaml");
    let config = dir.file("envoy.yaml");
    std::fs::write(&config, render_with_lds(&sims, &scenario, free_port(), &lds)).expect("write config");
    let envoy = EnvoyProcess::start(&dir, &config, &Launch::new("envoy"));
    for sim in &sims {
        envoy.wait_for_stat(&format!("poll_ok.{}", sim.name), 1, Duration::from_secs(10));
    }
    delay(&sims, 3000);
    let url = envoy.url("/generate");
    let busy = fill_ranks(&envoy, 8, "busy");
    let held = send(url.clone(), "held", Vec::new());
    envoy.wait_for_stat("admission.queued.standard", 1, Duration::from_secs(5));
    let after: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("tests/e2e/admission_reload/filter-after.json"))
            .expect("filter-after.json"),
    )
    .expect("JSON");
    let updates = || -> u64 {
        envoy
            .stats_matching("listener_manager.lds.update_success")
            .values()
            .sum()
    };
    let before = updates();
    write_lds(&lds, &lds_listener_with(&lds, &after));
    wait_until("the LDS update", Duration::from_secs(10), || {
        (updates() > before).then_some(())
    });
    let (reply, took) = held.join().expect("held request");
    eprintln!(
        "admission: held across a reload, answered {} {:?} after {took:?}",
        reply.status,
        reply.header("x-dprank-admission")
    );
    assert_eq!(reply.status, 503, "{reply:?}");
    assert_eq!(reply.header("x-dprank-admission"), Some("queue_timeout"));
    assert!(took < Duration::from_millis(1000 + 50 + 400), "{took:?}");
    // Drained listeners: requests in flight and held ones carry on.
    let held = send(url.clone(), "held2", Vec::new());
    envoy.wait_for_stat("admission.queued.standard", 2, Duration::from_secs(5));
    let drained = Client::new().post(
        &format!("http://{}/drain_listeners?graceful", envoy.admin),
        &[],
        b"",
    );
    assert_eq!(drained.status, 200, "{drained:?}");
    let (reply, took) = held.join().expect("held request");
    eprintln!(
        "admission: held across a drain, answered {} {:?} after {took:?}",
        reply.status,
        reply.header("x-dprank-admission")
    );
    assert!(
        reply.status == 503 && took < Duration::from_millis(1000 + 50 + 400),
        "{reply:?} after {took:?}"
    );
    assert_ok(busy);
    let forwarded = sims
        .iter()
        .flat_map(|s| s.requests())
        .filter(|r| r.body_text().contains("held"))
        .count();
    assert_eq!(forwarded, 0, "held requests that timed out were never forwarded");
    wait_until("the held gauge at 0", Duration::from_secs(2), || {
        (envoy.stat("admission.held") == 0).then_some(())
    });
}

/// Envoy's stream timeouts while a request is held: which keep running.
/// Each case starts Envoy with `edit` applied to the shipped listener's
/// connection manager, fills the ranks for `busy_ms` and sends one more
/// request with `headers`, held until then; returns its reply, how long it
/// took and whether it was forwarded.
fn held_under(edit: &dyn Fn(&mut Value), busy_ms: u64, headers: &[(&str, &str)]) -> (Reply, Duration, u64) {
    use crate::common::envoy::{render_config, SHIPPED_CONFIG};
    use crate::common::wasm_path;
    let scenario = Scenario::load("admission_queue");
    let dir = TestDir::new("admission_timeouts");
    let sims = start_sims(&dir, 2, &["--instant"]);
    let shipped = std::fs::read_to_string(repo_root().join(SHIPPED_CONFIG)).expect("shipped config");
    let workers: Vec<_> = sims.iter().map(|s| (s.name.as_str(), s.addr)).collect();
    let rendered = render_config(&shipped, &workers, &scenario.filter_overrides, &wasm_path(), None);
    let mut doc: Value = serde_yaml_ng::from_str(&rendered).expect("YAML");
    edit(&mut doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]);
    let config = dir.file("envoy.yaml");
    std::fs::write(&config, serde_yaml_ng::to_string(&doc).expect("YAML")).expect("write config");
    let envoy = EnvoyProcess::start(&dir, &config, &Launch::new("envoy"));
    for sim in &sims {
        envoy.wait_for_stat(&format!("poll_ok.{}", sim.name), 1, Duration::from_secs(10));
    }
    delay(&sims, busy_ms);
    let url = envoy.url("/generate");
    let busy = fill_ranks(&envoy, 8, "busy");
    let headers = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let (reply, took) = send(url, "held", headers).join().expect("held request");
    assert_ok(busy);
    std::thread::sleep(Duration::from_millis(200));
    let forwarded = sims
        .iter()
        .flat_map(|s| s.requests())
        .filter(|r| r.body_text().contains("held hello"))
        .count() as u64;
    wait_until("the held gauge at 0", Duration::from_secs(2), || {
        (envoy.stat("admission.held") == 0).then_some(())
    });
    eprintln!(
        "admission: held request got {} after {took:?}, forwarded {forwarded}, client_gone {}",
        reply.status,
        envoy.stat("admission.client_gone.standard")
    );
    (reply, took, forwarded)
}

#[test]
fn idle_and_duration_timeouts_run_while_held_request_and_route_timeouts_do_not() {
    // A route for the held request alone (header `x-held`), with `set`
    // merged into its `route`: the other requests keep the shipped one.
    fn held_route(set: Value) -> impl Fn(&mut Value) {
        move |hcm: &mut Value| {
            let routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
                .as_array_mut()
                .expect("routes");
            let mut route = routes[0].clone();
            route["match"] = json!({"prefix": "/", "headers": [{"name": "x-held", "present_match": true}]});
            for (k, v) in set.as_object().expect("an object") {
                route["route"][k] = v.clone();
            }
            routes.insert(0, route);
        }
    }
    // Its idle timeout (the listener's stream_idle_timeout alike): nothing
    // moves on a held stream.
    let idle = held_route(json!({"idle_timeout": "1s"}));
    // Envoy answers 504 "stream timeout" (the request was whole); the
    // filter sees the stream end and frees its place.
    let (reply, took, forwarded) = held_under(&idle, 3000, &[("x-held", "1")]);
    assert_eq!((reply.status, forwarded), (504, 0), "{reply:?}");
    assert!(took < Duration::from_millis(2000), "{took:?}");
    // max_stream_duration counts from the stream's start, held or not.
    let duration = held_route(json!({"max_stream_duration": {"max_stream_duration": "1s"}}));
    let (reply, took, forwarded) = held_under(&duration, 3000, &[("x-held", "1")]);
    assert_eq!(forwarded, 0, "{reply:?}");
    assert!(
        reply.status >= 400 && took < Duration::from_millis(2000),
        "{reply:?} {took:?}"
    );
    // request_timeout stops once the whole request has arrived: a request
    // held after its body (body mode) is not cut by it.
    let request = |hcm: &mut Value| hcm["request_timeout"] = json!("1s");
    let (reply, took, forwarded) = held_under(&request, 3000, &[]);
    assert_eq!((reply.status, forwarded), (200, 1), "{reply:?}");
    assert!(took > Duration::from_millis(5000), "{took:?}");
    // The route's timeout starts when the router gets the request: after
    // 1.5 s held and 1.5 s at the worker, a 2 s route timeout is not hit.
    let route = |hcm: &mut Value| {
        hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["timeout"] = json!("2s");
    };
    let (reply, took, forwarded) = held_under(&route, 1500, &[]);
    assert_eq!((reply.status, forwarded), (200, 1), "{reply:?}");
    assert!(took > Duration::from_millis(2500), "{took:?}");
}

#[test]
fn a_rank_with_its_cap_of_requests_refuses_the_next() {
    let scenario = Scenario::load("admission_cap");
    let dir = TestDir::new(&scenario.name);
    let sims = vec![Sim::start(&dir, "worker_a", 1, &["--instant"])];
    let envoy = Envoy::start(&dir, &scenario, &sims, &EnvoyOptions::default());
    envoy.wait_for_stat("poll_ok.worker_a", 1, Duration::from_secs(10));
    delay(&sims, 1500);
    let url = envoy.url("/generate");
    let first = send(url.clone(), "first", Vec::new());
    envoy.wait_for_stat("admission.admitted.standard", 1, Duration::from_secs(5));
    let (refused, took) = send(url.clone(), "second", Vec::new()).join().expect("second");
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.header("x-dprank-admission"), Some("saturated"));
    assert_eq!(refused.header("x-envoy-ratelimited"), Some("true"));
    assert!(refused.header("retry-after").is_some(), "{refused:?}");
    assert!(took < Duration::from_millis(500), "refused at once: {took:?}");
    assert_ok(vec![first]);
    delay(&sims, 0);
    let (after, _) = send(url, "third", Vec::new()).join().expect("third");
    assert_eq!(after.status, 200, "the rank is free again: {after:?}");
    let tags: Vec<String> = sims[0]
        .requests()
        .iter()
        .map(|r| r.body_text().to_string())
        .collect();
    assert_eq!(tags.len(), 2, "{tags:?}");
    assert!(!tags.iter().any(|t| t.contains("second hello")), "{tags:?}");
}

#[test]
fn server_priority_tells_the_worker_each_class_and_overrules_the_client() {
    let sent = |world: &World, tag: &str, class: Option<&str>| {
        let mut headers = vec![("x-override-priority".to_string(), "50".to_string())];
        if let Some(class) = class {
            headers.push(("x-dprank-priority".to_string(), class.to_string()));
        }
        let body =
            json!({"text": format!("{tag} hello"), "priority": 50, "sampling_params": {"max_new_tokens": 2}});
        let mut all: Vec<(&str, &str)> = vec![("content-type", "application/json")];
        all.extend(headers.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let reply = Client::new().post(&world.envoy.url("/generate"), &all, body.to_string().as_bytes());
        assert_eq!(reply.status, 200, "{reply:?}");
        world
            .sims
            .iter()
            .flat_map(|s| s.requests())
            .find(|r| r.body_text().contains(&format!("{tag} hello")))
            .expect("the request reached a worker")
    };
    let body_mode = World::start(
        "admission_priority",
        2,
        &["--instant"],
        &[],
        EnvoyOptions::default(),
    );
    let priority = |r: &crate::common::sim::Recorded| {
        serde_json::from_str::<Value>(r.body_text()).expect("a JSON body")["priority"].clone()
    };
    let critical = sent(&body_mode, "vip", Some("critical"));
    assert_eq!(priority(&critical), json!(1), "{critical:?}");
    assert_eq!(critical.header("x-override-priority"), None, "{critical:?}");
    let standard = sent(&body_mode, "plain", None);
    assert_eq!(
        priority(&standard),
        Value::Null,
        "the default class has none: {standard:?}"
    );
    drop(body_mode);
    let header_mode = World::start(
        "admission_priority_header",
        2,
        &["--instant", "--header-overrides"],
        &[],
        EnvoyOptions::default(),
    );
    let critical = sent(&header_mode, "vip", Some("critical"));
    assert_eq!(critical.header("x-override-priority"), Some("1"), "{critical:?}");
    assert_eq!(
        priority(&critical),
        json!(50),
        "the body untouched in header mode"
    );
    let standard = sent(&header_mode, "plain", None);
    assert_eq!(standard.header("x-override-priority"), None, "{standard:?}");
}

#[test]
fn slo_admission_learns_a_limit_from_answers_that_miss_their_target() {
    let scenario = Scenario::load("admission_slo");
    let dir = TestDir::new(&scenario.name);
    let sims = vec![Sim::start(&dir, "worker_a", 2, &["--time-scale", "5"])];
    let envoy = Envoy::start(&dir, &scenario, &sims, &EnvoyOptions::default());
    envoy.wait_for_stat("poll_ok.worker_a", 1, Duration::from_secs(10));
    let url = envoy.url("/generate");
    // Both ranks hold a request the worker holds back; then a third comes.
    let third_while_both_held = |tag: &str| {
        delay(&sims, 1500);
        let held = fill_ranks(&envoy, 2, &format!("{tag}-held"));
        let third = send(url.clone(), &format!("{tag}-third"), Vec::new())
            .join()
            .expect("third");
        assert_ok(held);
        third
    };

    // Nothing learned: the third goes through.
    let (third, _) = third_while_both_held("before");
    assert_eq!(third.status, 200, "nothing learned yet: {third:?}");

    // Sixty streamed answers, one at a time, each missing 1 ms per token.
    delay(&sims, 0);
    for i in 0..60 {
        let body = json!({"text": format!("teach{i} hello"), "stream": true,
            "sampling_params": {"max_new_tokens": 10}});
        let reply = Client::new().post(
            &url,
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        );
        assert_eq!(reply.status, 200, "{reply:?}");
    }
    // The next ticks write what the threads saw into the shared record.
    std::thread::sleep(Duration::from_millis(1_000));

    // The worker's limit is now one request per rank (it was answered
    // with one at a time): with both ranks holding one, a third is refused.
    let (refused, took) = third_while_both_held("after");
    assert_eq!(refused.status, 429, "the learned limit: {refused:?}");
    assert_eq!(refused.header("x-dprank-admission"), Some("saturated"));
    assert!(refused.header("retry-after").is_some(), "{refused:?}");
    assert!(took < Duration::from_millis(500), "refused at once: {took:?}");
    assert!(
        !sims[0]
            .requests()
            .iter()
            .any(|r| r.body_text().contains("after-third")),
        "the refused request never reached the worker"
    );
}
