//! Prefill/decode disaggregation in a real Envoy (`envoy/pd.yaml`): two
//! prefill workers (dp 2, with bootstrap listeners) and two decode workers
//! (dp 4). dprank sends the prefill leg itself and forwards the decode leg;
//! the simulated decode worker only answers once the prefill's KV room is
//! ready on the bootstrap port the body names, so a wrong bootstrap field
//! fails the request.

use crate::common::pd::{inserted_fields, PdTrace, PdWorld};
use serde_json::{json, Map, Value};
use std::io::{BufRead, BufReader, Read};
use std::time::{Duration, Instant};

/// Allowance on top of "within two poll intervals" for process scheduling on
/// a shared two-core machine.
const SCHEDULING_SLACK: Duration = Duration::from_millis(300);

/// Per-rank base tokens, prefill_a, prefill_b (dp 2), decode_a, decode_b (dp
/// 4): the lowest prefill pair is (prefill_b, 1), the lowest decode pair
/// (decode_a, 2).
const LOADS: [&[u64]; 4] = [
    &[3000, 5000],
    &[4000, 1000],
    &[5000, 6000, 1500, 7000],
    &[4000, 3000, 5000, 6000],
];
/// Five times faster than real; a decode leg whose room never comes fails
/// after 3 s.
const SIM_ARGS: &[&str] = &["--time-scale", "5", "--kv-wait-timeout-ms", "3000"];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Naming {
    Current,
    Legacy,
}

fn pair(worker: &str, rank: u64) -> (String, u64) {
    (worker.to_string(), rank)
}

/// The fields both legs must carry beyond the client's, for this trace's
/// prefill and decode choices and the rooms the decode leg got.
fn expected_fields(
    world: &PdWorld,
    naming: Naming,
    trace: &PdTrace,
    batch: Option<usize>,
    rooms: &Value,
) -> (Map<String, Value>, Map<String, Value>) {
    let (p_worker, p) = &trace.prefill;
    let d = trace.decode.1;
    let port = world.bootstrap_port(p_worker);
    let host = world.prefill_sim(p_worker).addr.ip().to_string();
    let (host, port) = match batch {
        Some(n) => (json!(vec![host; n]), json!(vec![port; n])),
        None => (json!(host), json!(port)),
    };
    let mut common = Map::new();
    common.insert("bootstrap_host".into(), host);
    common.insert("bootstrap_port".into(), port);
    common.insert("bootstrap_room".into(), rooms.clone());
    let mut prefill = common.clone();
    let mut decode = common;
    match naming {
        Naming::Current => {
            prefill.insert("routed_dp_rank".into(), json!(p));
            decode.insert("routed_dp_rank".into(), json!(d));
            decode.insert("disagg_prefill_dp_rank".into(), json!(p));
        }
        Naming::Legacy => {
            for body in [&mut prefill, &mut decode] {
                body.insert("data_parallel_rank".into(), json!(p));
                body.insert("decode_dp_rank".into(), json!(d));
            }
        }
    }
    (prefill, decode)
}

/// Rooms are integers in [0, 2^63-1]; for a batch, one per prompt, all different.
fn check_rooms(rooms: &Value, batch: Option<usize>) {
    let list: Vec<&Value> = match batch {
        Some(n) => {
            let list = rooms
                .as_array()
                .unwrap_or_else(|| panic!("batched rooms: {rooms}"));
            assert_eq!(list.len(), n, "one room per prompt: {rooms}");
            list.iter().collect()
        }
        None => vec![rooms],
    };
    let mut seen = Vec::new();
    for room in list {
        let value = room.as_u64().unwrap_or_else(|| panic!("room {room} is no u64"));
        assert!(value < 1 << 63, "room {value} out of [0, 2^63-1]");
        assert!(!seen.contains(&value), "room {value} used twice in {rooms}");
        seen.push(value);
    }
}

/// Sends `body`, checks that both legs got the client's body byte for byte
/// plus exactly the expected fields, on the expected (worker, rank) pairs.
fn check_exchange(
    world: &PdWorld,
    naming: Naming,
    path: &str,
    body: &str,
    batch: Option<usize>,
    expect: (&(String, u64), &(String, u64)),
) -> PdTrace {
    let trace = world.exchange(path, body);
    assert_eq!(
        (&trace.prefill, &trace.decode),
        expect,
        "{path}: (prefill, decode) pairs"
    );
    for recorded in [&trace.prefill_request, &trace.decode_request] {
        assert_eq!(recorded.path, path);
        assert_eq!(
            recorded.header("content-length"),
            Some(recorded.body.len().to_string().as_str()),
            "{path}: content-length matches the body each worker got"
        );
    }
    let prefill_fields = inserted_fields(body.as_bytes(), &trace.prefill_request.body);
    let decode_fields = inserted_fields(body.as_bytes(), &trace.decode_request.body);
    let rooms = decode_fields
        .get("bootstrap_room")
        .cloned()
        .unwrap_or_else(|| panic!("{path}: no bootstrap_room in the decode body"));
    check_rooms(&rooms, batch);
    assert_eq!(
        prefill_fields.get("bootstrap_room"),
        Some(&rooms),
        "{path}: the rooms of both legs match"
    );
    let (want_prefill, want_decode) = expected_fields(world, naming, &trace, batch, &rooms);
    assert_eq!(
        prefill_fields, want_prefill,
        "{path}: fields added to the prefill body"
    );
    assert_eq!(
        decode_fields, want_decode,
        "{path}: fields added to the decode body"
    );
    trace
}

/// Bodies in both naming profiles: single prompts on every serving path (odd
/// formatting kept), a batch of texts, client headers on the prefill leg.
fn bodies_carry_the_fields(world: &PdWorld, naming: Naming) {
    let expect = (&pair("prefill_b", 1), &pair("decode_a", 2));
    let single = [
        (
            "/generate",
            " {\"text\" : \"Say \\\"hi\\\" caf\u{e9} \u{1f680}\",\n \"sampling_params\":{\"max_new_tokens\":2, \
             \"temperature\":0.50},\"zeta\":[1,2.50,{}], \"alpha\":null }\n",
        ),
        (
            "/v1/completions",
            "{\"prompt\":\"\u{65e5}\u{672c} \\t tab\",\"max_tokens\":1,\"logit_bias\":{\"50256\":-100}}",
        ),
        (
            "/v1/chat/completions",
            "{\n  \"model\": \"sim-model\",\n  \"messages\": [{\"role\": \"user\", \"content\": \"hello\"}],\n  \
             \"max_tokens\": 1\n}",
        ),
    ];
    for (path, body) in single {
        check_exchange(world, naming, path, body, None, expect);
    }
    let batched =
        "{\"text\":[\"one\", \"two two\", \"three three three\"],\"sampling_params\":{\"max_new_tokens\":1}}";
    let trace = check_exchange(world, naming, "/generate", batched, Some(3), expect);
    eprintln!(
        "{naming:?}: batched decode body {}",
        trace.decode_request.body_text()
    );

    // Auth and tracing headers go on the prefill leg too.
    let (_, trace) = world.exchange_with(
        "/generate",
        "{\"text\":\"headers\"}",
        &[
            ("authorization", "Bearer t0ken"),
            ("x-request-id", "req-42"),
            (
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
            ("tracestate", "vendor=x"),
        ],
    );
    for recorded in [&trace.prefill_request, &trace.decode_request] {
        assert_eq!(recorded.header("authorization"), Some("Bearer t0ken"));
        assert_eq!(recorded.header("x-request-id"), Some("req-42"));
        assert_eq!(
            recorded.header("traceparent"),
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        );
        assert_eq!(recorded.header("tracestate"), Some("vendor=x"));
    }
}

/// A streamed request: the client gets the decode worker's SSE chunks as
/// they are made.
fn decode_response_streams(world: &PdWorld) {
    let body = json!({"text": "stream me", "sampling_params": {"max_new_tokens": 100}, "stream": true});
    let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(30)).build();
    let sent = Instant::now();
    let response = agent
        .post(&world.envoy.url("/generate"))
        .set("content-type", "application/json")
        .send_string(&body.to_string())
        .unwrap_or_else(|e| panic!("streamed PD request: {e}"));
    assert_eq!(response.status(), 200);
    let decode_a = &world.decode[0];
    assert_eq!(
        response.header("x-sim-worker"),
        Some(decode_a.addr.to_string().as_str())
    );
    assert_eq!(response.header("x-sim-dp-rank"), Some("2"));
    assert!(
        response
            .header("content-type")
            .is_some_and(|t| t.starts_with("text/event-stream")),
        "content-type {:?}",
        response.header("content-type")
    );
    let mut reader = BufReader::new(response.into_reader().take(1 << 20));
    let mut events: Vec<(Duration, String)> = Vec::new();
    let mut line = String::new();
    while reader.read_line(&mut line).expect("read the stream") > 0 {
        if let Some(data) = line.trim_end().strip_prefix("data: ") {
            events.push((sent.elapsed(), data.to_string()));
        } else {
            assert!(line.trim().is_empty(), "not an SSE line: {line:?}");
        }
        line.clear();
    }
    let (done_at, last) = events.last().cloned().expect("stream events");
    assert_eq!(last, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|(_, data)| serde_json::from_str(data).unwrap_or_else(|e| panic!("chunk {data:?}: {e}")))
        .collect();
    assert_eq!(chunks.len(), 100, "one chunk per token");
    let final_chunk = chunks.last().expect("chunks");
    assert_eq!(final_chunk["meta_info"]["completion_tokens"], 100);
    assert_eq!(final_chunk["meta_info"]["finish_reason"]["type"], "length");
    let first_at = events[0].0;
    eprintln!(
        "PD stream: {} events, first after {first_at:?}, [DONE] after {done_at:?}",
        events.len()
    );
    assert!(
        first_at + Duration::from_millis(200) < done_at,
        "the first chunk ({first_at:?}) must come well before the end ({done_at:?}): buffered?"
    );
    // The prefill leg of that room was asked for a stream too and drained.
    let trace = world.trace(&decode_a.addr.to_string(), 2);
    assert_eq!(trace.prefill, pair("prefill_b", 1));
    assert_eq!(trace.prefill_request.body_json()["stream"], true);
    assert_eq!(trace.prefill_request.status, Some(200));
}

/// The choice in each pool follows its loads within two poll intervals.
fn choices_follow_the_loads(world: &PdWorld) {
    let interval = world.interval();
    let old = (pair("prefill_b", 1), pair("decode_a", 2));
    let new = (pair("prefill_a", 0), pair("decode_b", 1));
    // One worker per pool changes, so every poll sees the old or the new lowest pair of that pool.
    world.prefill[0].set_base_tokens(&[500, 5000]);
    world.decode[1].set_base_tokens(&[4000, 800, 5000, 6000]);
    let changed = Instant::now();
    let mut probes = 0;
    loop {
        probes += 1;
        let body = json!({"text": format!("probe {probes}"), "sampling_params": {"max_new_tokens": 1}});
        let trace = world.exchange("/generate", &body.to_string());
        let got = (trace.prefill.clone(), trace.decode.clone());
        if got == new {
            break;
        }
        assert!(
            [&old.0, &new.0].contains(&&got.0) && [&old.1, &new.1].contains(&&got.1),
            "probe {probes}: {got:?} is neither the old nor the new lowest pair of each pool"
        );
        assert!(
            changed.elapsed() < 2 * interval + SCHEDULING_SLACK,
            "still {got:?} {:?} after the loads changed (poll every {interval:?})",
            changed.elapsed()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "PD: both choices followed the loads after {:?} ({probes} probes)",
        changed.elapsed()
    );
    for i in 0..5 {
        let trace = world.exchange("/generate", &json!({"text": format!("after {i}")}).to_string());
        assert_eq!((trace.prefill, trace.decode), new);
    }
}

#[test]
fn pd_current_naming_bodies_stream_and_follow_loads() {
    let world = PdWorld::start("pd_current", 2, 4, SIM_ARGS, &LOADS);
    bodies_carry_the_fields(&world, Naming::Current);
    decode_response_streams(&world);
    choices_follow_the_loads(&world);
    // Six legs went to prefill_b before the loads changed (four checked
    // bodies, the header check, the stream), and at least six to prefill_a
    // after (the probe that saw the change and five more). How many probes
    // the change took depends on the poll's phase, so they are not counted.
    assert!(world.envoy.stat("prefill_ok.prefill_b") >= 6);
    assert!(world.envoy.stat("prefill_ok.prefill_a") >= 6);
    assert_eq!(world.envoy.stat("prefill_failed.prefill_a"), 0);
    assert_eq!(world.envoy.stat("prefill_failed.prefill_b"), 0);
}

#[test]
fn pd_legacy_naming_bodies() {
    let world = PdWorld::start("pd_legacy", 2, 4, SIM_ARGS, &LOADS);
    bodies_carry_the_fields(&world, Naming::Legacy);
}

/// A client answer from dprank itself: 502 (no decode worker header) with
/// the JSON error shape.
fn assert_clean_502(reply: &crate::common::Reply, what: &str) -> String {
    assert_eq!(reply.status, 502, "{what}: {reply:?}");
    assert_eq!(
        reply.header("content-type"),
        Some("application/json"),
        "{what}: {reply:?}"
    );
    assert!(
        reply.header("x-sim-worker").is_none(),
        "{what}: the decode response must not leak: {reply:?}"
    );
    let error = reply.json();
    assert_eq!(error["error"]["type"], "prefill_failed", "{what}: {error}");
    assert_eq!(error["error"]["code"], "dprank", "{what}: {error}");
    error["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("{what}: no message in {error}"))
        .to_string()
}

/// Waits until no decode request is left in flight (the decode leg of a
/// failed prefill must not hang on).
fn decode_legs_finish(world: &PdWorld, what: &str) -> Duration {
    let start = Instant::now();
    crate::common::wait_until(
        &format!("{what}: the decode legs in flight finish"),
        Duration::from_secs(5),
        || {
            let busy: u64 = world
                .decode
                .iter()
                .flat_map(|s| {
                    s.counters()["in_flight_per_rank"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .filter_map(|v| v.as_u64())
                .sum();
            (busy == 0).then(|| start.elapsed())
        },
    )
}

#[test]
fn pd_prefill_failures_become_502() {
    // stale_after_ms is 10 s here: avoiding the dead worker below comes from
    // its failed prefill, not from its data going stale.
    let mut world = PdWorld::start("pd_prefill_failures", 2, 4, SIM_ARGS, &LOADS);
    let ok = json!({"text": "fine", "sampling_params": {"max_new_tokens": 1}}).to_string();
    let lowest = (pair("prefill_b", 1), pair("decode_a", 2));
    let trace = world.exchange("/generate", &ok);
    assert_eq!((trace.prefill, trace.decode), lowest);

    // A slow prefill answer: the decode worker has its answer long before
    // (the KV room is ready once prefilled, the answer comes 400 ms later),
    // but the client gets nothing until the prefill leg has answered.
    world.prefill[1].control(json!({"response_delay_ms": 400}));
    let streamed = json!({"text": "held", "sampling_params": {"max_new_tokens": 5}, "stream": true});
    let url = world.envoy.url("/generate");
    let sent = Instant::now();
    let client = std::thread::spawn(move || {
        let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(30)).build();
        let response = agent
            .post(&url)
            .set("content-type", "application/json")
            .send_string(&streamed.to_string())
            .unwrap_or_else(|e| panic!("held request: {e}"));
        let head_after = sent.elapsed();
        let worker = response.header("x-sim-worker").expect("x-sim-worker").to_string();
        (
            head_after,
            worker,
            response.into_string().expect("read the stream"),
        )
    });
    // The decode worker answers (status recorded) while the client still waits.
    let decode_answered =
        crate::common::wait_until("the decode worker's answer", Duration::from_secs(5), || {
            world.decode.iter().find_map(|sim| {
                let last = sim.requests().pop()?;
                (last.body_json()["text"] == "held" && last.status == Some(200)).then(|| sent.elapsed())
            })
        });
    let (head_after, worker, events) = client.join().expect("the client thread");
    assert_eq!(worker, world.decode[0].addr.to_string());
    assert!(events.trim_end().ends_with("data: [DONE]"), "{events}");
    eprintln!(
        "slow prefill answer: the decode worker answered after {decode_answered:?}, the client got the \
         head after {head_after:?}"
    );
    assert!(
        head_after >= Duration::from_millis(400) && head_after > decode_answered + Duration::from_millis(200),
        "the decode response reached the client after {head_after:?}, before the prefill leg answered"
    );
    world.prefill[1].control(json!({"response_delay_ms": 0}));
    assert_eq!(world.envoy.stat("prefill_failed.prefill_b"), 0);

    // The prefill leg times out (prefill_timeout_ms) after the decode worker
    // has answered: the held decode response becomes a clean 502.
    let timeout = Duration::from_millis(world.scenario.override_u64("prefill_timeout_ms").expect("set"));
    world.prefill[1].control(json!({"response_delay_ms": 3 * timeout.as_millis() as u64}));
    let sent = Instant::now();
    let reply = world.post("/generate", &json!({"text": "timed out"}).to_string());
    let took = sent.elapsed();
    let message = assert_clean_502(&reply, "prefill timeout");
    // Envoy answers a callout that timed out with its own 504.
    assert!(
        message.contains("did not answer") || message.contains("answered HTTP 504"),
        "{message}"
    );
    assert!(
        // Envoy's timers are at millisecond granularity.
        took + Duration::from_millis(20) >= timeout,
        "502 after {took:?}, the prefill timeout is {timeout:?}"
    );
    let decode_request = world.decode[0].last_request();
    assert_eq!(decode_request.body_json()["text"], "timed out");
    assert_eq!(decode_request.status, Some(200), "the decode worker had answered");
    assert_eq!(world.envoy.stat("prefill_failed.prefill_b"), 1);
    // Out of rotation until its next good poll, which comes at once: it is alive.
    world.prefill[1].control(json!({"response_delay_ms": 0}));
    let back = Instant::now();
    crate::common::wait_until(
        "prefill_b back in rotation",
        2 * world.interval() + SCHEDULING_SLACK,
        || {
            let trace = world.exchange("/generate", &ok);
            assert!(
                [pair("prefill_a", 0), pair("prefill_b", 1)].contains(&trace.prefill),
                "{:?}",
                trace.prefill
            );
            (trace.prefill == pair("prefill_b", 1)).then_some(())
        },
    );
    eprintln!(
        "prefill timeout: 502 after {took:?}; prefill_b back after {:?}",
        back.elapsed()
    );

    // The prefill leg answers 500: the client gets a 502 JSON error. A worker
    // that answers stays in rotation (only an unreachable one leaves it).
    world.prefill[1].control(json!({"serving_fault": "http_500"}));
    for attempt in 1..=2 {
        let reply = world.post("/generate", &ok);
        let message = assert_clean_502(&reply, "prefill 500");
        assert!(message.contains("answered HTTP 500"), "{message}");
        assert_eq!(world.envoy.stat("prefill_failed.prefill_b"), 1 + attempt);
    }
    eprintln!(
        "prefill 500: decode legs finished {:?} after the 502",
        decode_legs_finish(&world, "prefill 500")
    );
    world.prefill[1].control(json!({"serving_fault": "none"}));
    let trace = world.exchange("/generate", &ok);
    assert_eq!((trace.prefill, trace.decode), lowest, "back once it answers");

    // The prefill worker dies: one clean 502, then it gets no more traffic.
    let routed_to_b = |w: &PdWorld| -> u64 {
        (0..2)
            .map(|r| w.envoy.stat(&format!("routed.prefill_b.rank_{r}")))
            .sum()
    };
    world.kill_prefill("prefill_b");
    let killed = Instant::now();
    let reply = world.post("/generate", &ok);
    let message = assert_clean_502(&reply, "prefill worker dead");
    eprintln!("dead prefill worker: {message}");
    assert_eq!(world.envoy.stat("prefill_failed.prefill_b"), 4);
    let routed_before = routed_to_b(&world);
    for i in 0..10 {
        let body = json!({"text": format!("after the death {i}"), "sampling_params": {"max_new_tokens": 1}});
        let trace = world.exchange("/generate", &body.to_string());
        assert_eq!(
            (trace.prefill, trace.decode),
            (pair("prefill_a", 0), pair("decode_a", 2)),
            "request {i} after the death"
        );
    }
    let stale_after = Duration::from_millis(world.scenario.override_u64("stale_after_ms").expect("set"));
    assert!(
        killed.elapsed() < stale_after,
        "the dead worker's data was still fresh: it left rotation because its prefill failed"
    );
    assert_eq!(
        routed_to_b(&world),
        routed_before,
        "nothing routed to the dead worker"
    );
    assert_eq!(world.envoy.stat("prefill_failed.prefill_b"), 4);
    assert!(world.envoy.stat("prefill_ok.prefill_a") >= 10);
    assert_eq!(world.envoy.stat("prefill_failed.prefill_a"), 0);
    eprintln!(
        "dead prefill worker: decode legs finished {:?} after the requests",
        decode_legs_finish(&world, "prefill worker dead")
    );
}
