//! Admission in the request lifecycle on the fake host: refusals, held
//! requests let in by a later pass, time-outs, clients going away, classes,
//! tenants and the bound over threads. Each request is its own context.

use super::*;
use crate::admission::held_record;
use crate::host::fake::FakeHost;
use crate::host::HostError;
use crate::shared_data::testing::{fleet, json, poll, queue_prefill};
use std::collections::HashMap;

/// A queue on an 8-rank fleet: 1000 waiting tokens per rank and a drain
/// of 1000 tokens/s make every rank 1 s away, past `max_wait_ms` 500.
const QUEUE: &str = r#","admission":{"max_wait_ms":500,"prefill_tokens_per_s":1000,"learn_drain_rate":false,
    "when_saturated":"queue","max_queued":3,"queue_timeout_ms":2000,"tenant_header":"x-tenant"}"#;

fn routing(c: &Rc<Config>) -> Rc<Routing> {
    let routing = Rc::new(Routing::new(c.clone(), 0));
    routing.set_vm(1);
    routing
}

/// Request context `id` with `headers` sent whole: its headers and body
/// callbacks' actions.
fn arrive(
    h: &FakeHost,
    routing: &Rc<Routing>,
    id: u32,
    extra: &[(&str, &str)],
) -> (Rc<RefCell<Request>>, Action) {
    let body = br#"{"text":"hello there","stream":true}"#;
    let length = body.len().to_string();
    let mut headers = vec![
        (":method", "POST"),
        (":path", "/generate"),
        ("content-length", length.as_str()),
    ];
    headers.extend_from_slice(extra);
    h.start_request_as(id, &headers, body);
    let r = Request::shared(routing.clone(), id);
    let first = r.borrow_mut().on_request_headers(h, false);
    assert_eq!(first, Action::Pause, "body mode waits for the body");
    let action = r.borrow_mut().on_request_body(h, body.len(), true);
    (r, action)
}

/// The replies so far, as (context, status, admission reason).
fn replies(h: &FakeHost) -> Vec<(u32, u32, String)> {
    let contexts = h.reply_contexts.borrow();
    h.replies
        .borrow()
        .iter()
        .zip(contexts.iter())
        .map(|((status, headers, _), ctx)| {
            let reason = headers
                .iter()
                .find(|(k, _)| k == "x-dprank-admission")
                .map_or(String::new(), |(_, v)| v.clone());
            (*ctx, *status, reason)
        })
        .collect()
}

fn held_total(c: &Config, h: &FakeHost) -> u64 {
    held_record::read(c, h).total(h.now.get())
}

#[test]
fn reject_mode_answers_429_with_retry_after_and_admits_below_saturation() {
    let (c, h) =
        fleet(r#","admission":{"max_wait_ms":500,"prefill_tokens_per_s":1000,"learn_drain_rate":false}"#);
    let routing = routing(&c);
    let (_, action) = arrive(&h, &routing, 1, &[]);
    assert_eq!(action, Action::Continue, "room");
    assert_eq!(h.counter("dprank.admission.admitted.standard"), 1);
    queue_prefill(&c, &h, 1000);
    let (_, action) = arrive(&h, &routing, 2, &[("x-dprank-priority", "critical")]);
    assert_eq!(action, Action::Continue, "critical waits up to twice as long");
    let (_, action) = arrive(&h, &routing, 3, &[]);
    assert_eq!(action, Action::Pause);
    assert_eq!(replies(&h), [(3, 429, "saturated".to_string())]);
    let (_, headers, body) = h.replies.borrow()[0].clone();
    let header = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    assert_eq!(header("retry-after").as_deref(), Some("1"), "500 ms past: 1 s");
    assert_eq!(header("x-envoy-ratelimited").as_deref(), Some("true"));
    assert!(String::from_utf8_lossy(&body).contains("saturated"));
    assert_eq!(h.counter("dprank.rejected.saturated"), 1);
    assert_eq!(h.counter("dprank.admission.rejected.saturated.standard"), 1);
    assert_eq!(h.counter("dprank.admission.admitted.critical"), 1);
    assert_eq!(h.header("x-dprank-endpoint"), None, "not routed");
}

#[test]
fn a_held_request_is_let_in_when_room_comes_and_not_twice() {
    let (c, h) = fleet(QUEUE);
    let routing = routing(&c);
    queue_prefill(&c, &h, 1000);
    let (r, action) = arrive(&h, &routing, 7, &[]);
    assert_eq!(action, Action::Pause, "held");
    assert!(r.borrow().is_held() && h.replies.borrow().is_empty());
    assert_eq!(h.counter("dprank.admission.queued.standard"), 1);
    assert_eq!(held_total(&c, &h), 1);
    // A tick while still saturated changes nothing.
    on_admission_tick(&routing, &h, 0);
    assert!(r.borrow().is_held() && h.resumed_contexts.borrow().is_empty());
    // Room: the next tick routes it on its own context and resumes it.
    h.now.set(10_300);
    queue_prefill(&c, &h, 0);
    on_admission_tick(&routing, &h, 0);
    assert_eq!(*h.resumed_contexts.borrow(), [7]);
    assert!(!r.borrow().is_held());
    assert_eq!(h.context.get(), 0, "the root's context is effective again");
    assert!(h.set_effective_context(7).is_ok());
    assert!(h.header("x-dprank-endpoint").is_some());
    assert_eq!(json(&h.request_body.borrow())["text"], "hello there");
    assert_eq!(h.histogram_values("dprank.admission.queue_wait_ms"), [300]);
    assert_eq!(held_total(&c, &h), 0);
    assert_eq!(h.counter("dprank.admission.admitted.standard"), 1);
    on_admission_tick(&routing, &h, 0);
    assert_eq!(h.resumed_contexts.borrow().len(), 1, "let in once");
    r.borrow_mut().on_done(&h);
    assert_eq!(held_total(&c, &h), 0);
}

#[test]
fn a_request_waiting_past_the_time_out_gets_503_with_retry_after() {
    let (c, h) = fleet(QUEUE);
    let routing = routing(&c);
    queue_prefill(&c, &h, 1000);
    let (r, _) = arrive(&h, &routing, 3, &[]);
    // Ticks every 50 ms: answered at the last one that comes before the
    // 2000 ms are up, so never held longer.
    h.now.set(10_000 + 1950);
    on_admission_tick(&routing, &h, 0);
    assert!(r.borrow().is_held(), "the next tick is still in time");
    h.now.set(10_000 + 1951);
    on_admission_tick(&routing, &h, 0);
    assert_eq!(replies(&h), [(3, 503, "queue_timeout".to_string())]);
    let (_, headers, _) = h.replies.borrow()[0].clone();
    assert!(headers.contains(&("retry-after".to_string(), "1".to_string())));
    assert!(headers.contains(&("x-envoy-overloaded".to_string(), "true".to_string())));
    assert_eq!(h.counter("dprank.admission.rejected.queue_timeout.standard"), 1);
    assert_eq!(held_total(&c, &h), 0);
    assert_eq!(h.histogram_values("dprank.admission.queue_wait_ms"), [1951]);
    r.borrow_mut().on_done(&h);
    assert_eq!(held_total(&c, &h), 0, "its place freed once");
}

#[test]
fn a_client_gone_while_held_frees_its_place() {
    let (c, h) = fleet(QUEUE);
    let routing = routing(&c);
    queue_prefill(&c, &h, 1000);
    let (r, _) = arrive(&h, &routing, 4, &[]);
    assert_eq!(held_total(&c, &h), 1);
    h.now.set(10_050);
    r.borrow_mut().on_done(&h);
    h.end_context(4);
    assert_eq!(held_total(&c, &h), 0);
    assert_eq!(h.counter("dprank.admission.client_gone.standard"), 1);
    queue_prefill(&c, &h, 0);
    on_admission_tick(&routing, &h, 0);
    assert!(h.resumed_contexts.borrow().is_empty() && h.replies.borrow().is_empty());
}

#[test]
fn sheddable_requests_are_refused_at_once_and_a_full_queue_keeps_the_higher_class() {
    let (c, h) = fleet(QUEUE);
    let routing = routing(&c);
    queue_prefill(&c, &h, 5000);
    let (_, action) = arrive(&h, &routing, 1, &[("x-dprank-priority", "sheddable")]);
    assert_eq!(action, Action::Pause);
    assert_eq!(replies(&h), [(1, 429, "sheddable".to_string())]);
    let held: Vec<_> = (2..=4).map(|id| arrive(&h, &routing, id, &[]).0).collect();
    assert_eq!(held_total(&c, &h), 3, "max_queued");
    arrive(&h, &routing, 5, &[]);
    assert_eq!(replies(&h)[1], (5, 429, "queue_full".to_string()), "same class");
    // A critical request takes the newest standard one's place.
    let (critical, _) = arrive(&h, &routing, 6, &[("x-dprank-priority", "critical")]);
    assert!(critical.borrow().is_held());
    assert_eq!(replies(&h)[2], (4, 429, "displaced".to_string()));
    assert_eq!(h.context.get(), 6, "the arrival's context is effective again");
    assert_eq!(held_total(&c, &h), 3);
    assert_eq!(h.counter("dprank.admission.rejected.displaced.standard"), 1);
    // Room for all: the critical one first, then in arrival order.
    queue_prefill(&c, &h, 0);
    on_admission_tick(&routing, &h, 0);
    assert_eq!(*h.resumed_contexts.borrow(), [6, 2, 3]);
    assert_eq!(held_total(&c, &h), 0);
    assert!(held.iter().all(|r| !r.borrow().is_held()));
}

/// One worker with one rank draining 5 tokens/s: a request's prompt (3
/// tokens) is 600 ms of wait, past the 500 ms limit: room for one request
/// at a time until its first byte.
fn one_rank() -> (Rc<Config>, FakeHost) {
    let c = Rc::new(
        Config::from_json(
            br#"{"workers":[{"address":"127.0.0.1:1","name":"a"}],"admission":{"max_wait_ms":500,
            "prefill_tokens_per_s":5,"learn_drain_rate":false,"when_saturated":"queue","tenant_header":"x-tenant"}}"#,
        )
        .unwrap(),
    );
    let h = FakeHost::default();
    h.now.set(10_000);
    poll(&c, &h, 0, &[0]);
    (c, h)
}

#[test]
fn held_requests_go_in_class_order_then_tenants_in_turn() {
    let (c, h) = one_rank();
    let routing = routing(&c);
    queue_prefill(&c, &h, 100_000);
    let order = [
        (1, "standard", "a"),
        (2, "standard", "a"),
        (3, "standard", "b"),
        (4, "critical", "z"),
        (5, "standard", "c"),
    ];
    let mut requests = HashMap::new();
    for (id, class, tenant) in order {
        let (r, action) = arrive(
            &h,
            &routing,
            id,
            &[("x-dprank-priority", class), ("x-tenant", tenant)],
        );
        assert_eq!(action, Action::Pause, "{id}");
        requests.insert(id, r);
    }
    queue_prefill(&c, &h, 0);
    for _ in 0..order.len() {
        let before = h.resumed_contexts.borrow().len();
        on_admission_tick(&routing, &h, 0);
        let resumed = h.resumed_contexts.borrow().clone();
        assert_eq!(resumed.len(), before + 1, "one at a time: {resumed:?}");
        // Its first byte: its prompt leaves the rank's queue.
        let id = resumed[before];
        assert!(h.set_effective_context(id).is_ok());
        let mut r = requests[&id].borrow_mut();
        r.on_response_headers(&h);
        r.on_response_body(&h, 0);
    }
    assert_eq!(
        *h.resumed_contexts.borrow(),
        [4, 1, 3, 5, 2],
        "critical first, then tenants a, b, c, a"
    );
}

#[test]
fn header_mode_holds_at_the_headers_and_keeps_the_body_back() {
    let (c, h) = fleet(&format!(r#","rank_transport":"header"{QUEUE}"#));
    let routing = routing(&c);
    queue_prefill(&c, &h, 1000);
    h.start_request_as(
        9,
        &[
            (":method", "POST"),
            (":path", "/generate"),
            ("content-length", "400"),
        ],
        b"",
    );
    let r = Request::shared(routing.clone(), 9);
    assert_eq!(r.borrow_mut().on_request_headers(&h, false), Action::Pause);
    assert!(r.borrow().is_held());
    assert_eq!(r.borrow_mut().on_request_body(&h, 200, false), Action::Pause);
    queue_prefill(&c, &h, 0);
    on_admission_tick(&routing, &h, 0);
    assert_eq!(*h.resumed_contexts.borrow(), [9]);
    assert!(h.set_effective_context(9).is_ok());
    assert!(h.header("x-data-parallel-rank").is_some());
    assert_eq!(r.borrow_mut().on_request_body(&h, 400, true), Action::Continue);
}

#[test]
fn the_filter_going_away_answers_every_held_request() {
    let (c, h) = fleet(QUEUE);
    let routing = routing(&c);
    queue_prefill(&c, &h, 5000);
    let _held = [
        arrive(&h, &routing, 1, &[]).0,
        arrive(&h, &routing, 2, &[("x-dprank-priority", "critical")]).0,
    ];
    drain_held(&routing, &h, 0);
    let mut got = replies(&h);
    got.sort();
    assert_eq!(
        got,
        [(1, 503, "draining".to_string()), (2, 503, "draining".to_string())]
    );
    assert_eq!(held_total(&c, &h), 0);
}

#[test]
fn a_higher_class_on_another_thread_goes_first_and_takes_a_place_here() {
    let (c, h) = fleet(QUEUE);
    let (here, there) = (routing(&c), Rc::new(Routing::new(c.clone(), 1)));
    there.set_vm(2);
    queue_prefill(&c, &h, 5000);
    let _held: Vec<_> = (1..=3).map(|id| arrive(&h, &here, id, &[]).0).collect();
    let (critical, _) = arrive(&h, &there, 10, &[("x-dprank-priority", "critical")]);
    assert!(critical.borrow().is_held(), "a place another thread gives up");
    assert_eq!(held_total(&c, &h), 4, "for a tick at most");
    on_admission_tick(&here, &h, 0);
    assert_eq!(replies(&h), [(3, 429, "displaced".to_string())]);
    assert_eq!(held_total(&c, &h), 3);
    // Room: `here` sees the critical request on `there` and waits for it.
    queue_prefill(&c, &h, 0);
    on_admission_tick(&here, &h, 0);
    assert!(h.resumed_contexts.borrow().is_empty());
    on_admission_tick(&there, &h, 0);
    assert_eq!(*h.resumed_contexts.borrow(), [10]);
    on_admission_tick(&here, &h, 0);
    on_admission_tick(&here, &h, 0);
    assert_eq!(*h.resumed_contexts.borrow(), [10, 1, 2]);
}

#[test]
fn a_held_request_whose_stream_is_gone_when_let_in_leaves_the_queue_once() {
    // The proxy refuses to make it effective: its stream went without an end here.
    let (c, h) = fleet(QUEUE);
    let routing = routing(&c);
    queue_prefill(&c, &h, 1000);
    let (r, _) = arrive(&h, &routing, 5, &[]);
    h.end_context(5);
    h.now.set(10_100);
    queue_prefill(&c, &h, 0);
    on_admission_tick(&routing, &h, 0);
    assert!(h.resumed_contexts.borrow().is_empty() && h.replies.borrow().is_empty());
    assert_eq!(h.counter("dprank.host_refused.effective_context"), 1);
    assert_eq!(h.counter("dprank.admission.client_gone.standard"), 1);
    assert_eq!(held_total(&c, &h), 0);
    // Its end, when it comes, counts nothing twice.
    r.borrow_mut().on_done(&h);
    assert_eq!(h.counter("dprank.admission.client_gone.standard"), 1);
    assert_eq!(held_total(&c, &h), 0);
}

#[test]
fn a_held_request_the_proxy_will_not_resume_gives_back_its_estimate_at_its_end() {
    let (c, h) = fleet(QUEUE);
    let routing = routing(&c);
    queue_prefill(&c, &h, 1000);
    let (r, _) = arrive(&h, &routing, 6, &[]);
    h.refuse("resume_request", HostError::BAD_ARGUMENT);
    h.now.set(10_100);
    queue_prefill(&c, &h, 0);
    on_admission_tick(&routing, &h, 0);
    assert_eq!(h.counter("dprank.host_refused.resume_request"), 1);
    assert!(!r.borrow().is_held(), "out of the queue");
    let pending = |h: &FakeHost| -> u64 {
        crate::shared_data::read_worker_states(&c, h)
            .iter()
            .flatten()
            .map(|s| s.pending_total())
            .sum()
    };
    assert!(pending(&h) > 0, "routed: its estimate is charged");
    r.borrow_mut().on_done(&h);
    assert_eq!(pending(&h), 0, "and given back once at its end");
    assert_eq!(held_total(&c, &h), 0);
}

#[test]
fn a_refusal_the_proxy_cannot_deliver_is_dropped_and_counted() {
    let (c, h) =
        fleet(r#","admission":{"max_wait_ms":500,"prefill_tokens_per_s":1000,"learn_drain_rate":false}"#);
    let routing = routing(&c);
    queue_prefill(&c, &h, 1000);
    h.refuse("send_response", HostError::BAD_ARGUMENT);
    let (_, action) = arrive(&h, &routing, 2, &[]);
    assert_eq!(
        action,
        Action::Pause,
        "refused, though the answer could not be sent"
    );
    assert!(h.replies.borrow().is_empty());
    assert_eq!(h.counter("dprank.host_refused.local_reply"), 1);
    assert_eq!(h.counter("dprank.rejected.saturated"), 1);
}
