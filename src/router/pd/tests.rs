use super::super::{Decision, Input, RejectReason};
use super::*;
use crate::host::fake::FakeHost;
use crate::reply::Reply;
use crate::shared_data::cache::StateCache;
use crate::shared_data::testing::*;

/// Routes `body` through the real entry as a request of the default class.
fn route(
    c: &Rc<Config>,
    h: &dyn Host,
    cache: &mut StateCache,
    body: &[u8],
    pin: Option<&str>,
    tie_breaker: u64,
) -> Decision {
    let args = RouteArgs {
        pin,
        tie_breaker,
        class: None,
    };
    super::super::route(c, h, cache, Input::Body(body), &args).expect("no admission")
}

fn pd(d: Decision) -> PdRouted {
    match d {
        Decision::Pd(pd) => pd,
        other => panic!("expected PD routing, got {other:?}"),
    }
}

#[test]
fn pd_picks_both_pools_and_writes_matching_bootstrap_fields() {
    let (c, h) = pd_fleet("");
    let r = pd(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"text":"hello","stream":true}"#,
        None,
        0,
    ));
    assert_eq!(
        (r.prefill.worker, r.prefill.rank, r.prefill.endpoint.as_ref()),
        (2, Some(1), "10.0.0.1:30000")
    );
    let decode = r.decode.unwrap();
    assert_eq!(
        (decode.worker, decode.rank, decode.endpoint.as_ref()),
        (1, Some(1), "10.0.1.2:30000")
    );
    let (p, d) = (json(&r.prefill_body), json(&r.decode_body));
    assert_eq!(p["bootstrap_host"], "10.0.0.1");
    assert_eq!(p["bootstrap_port"], 8998);
    assert_eq!(p["bootstrap_room"], d["bootstrap_room"]);
    assert!(p["bootstrap_room"].as_u64().unwrap() <= i64::MAX as u64);
    assert_eq!(
        (p["routed_dp_rank"].as_u64(), p.get("disagg_prefill_dp_rank")),
        (Some(1), None)
    );
    assert_eq!(
        (d["routed_dp_rank"].as_u64(), d["disagg_prefill_dp_rank"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(d["bootstrap_host"], "10.0.0.1");
    assert_eq!(
        (p["text"].as_str(), d["stream"].as_bool()),
        (Some("hello"), Some(true))
    );
    assert!(r.prefill_estimate.is_some() && r.decode_estimate.is_some());
    assert_eq!(
        h.counter("dprank.routed.p0.rank_1") + h.counter("dprank.routed.d1.rank_1"),
        2
    );
}

#[test]
fn pd_legacy_naming_sends_both_ranks_on_both_bodies() {
    let (c, h) = pd_fleet(r#","naming":"legacy""#);
    let r = pd(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"text":"hello"}"#,
        None,
        0,
    ));
    for body in [&r.prefill_body, &r.decode_body] {
        let v = json(body);
        assert_eq!(
            (v["data_parallel_rank"].as_u64(), v["decode_dp_rank"].as_u64()),
            (Some(1), Some(1))
        );
        assert!(v.get("routed_dp_rank").is_none());
    }
}

#[test]
fn pd_batched_text_gets_one_room_per_prompt() {
    let (c, h) = pd_fleet("");
    let r = pd(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"text":["a","b","c"]}"#,
        None,
        0,
    ));
    let (p, d) = (json(&r.prefill_body), json(&r.decode_body));
    assert_eq!(
        p["bootstrap_host"],
        serde_json::json!(["10.0.0.1", "10.0.0.1", "10.0.0.1"])
    );
    assert_eq!(p["bootstrap_port"], serde_json::json!([8998, 8998, 8998]));
    let rooms = p["bootstrap_room"].as_array().unwrap();
    assert_eq!(rooms.len(), 3);
    assert_ne!(rooms[0], rooms[1]);
    assert_eq!(p["bootstrap_room"], d["bootstrap_room"]);
}

#[test]
fn pd_without_prefill_data_rotates_and_lets_the_prefill_server_pick_its_rank() {
    let c = std::rc::Rc::new(
        Config::from_json(
            br#"{"prefill_workers":[{"address":"10.0.0.1:1"},{"address":"10.0.0.2:1"}],"decode_workers":[{"address":"10.0.1.1:1"}]}"#,
        )
        .unwrap(),
    );
    let h = FakeHost::default();
    h.now.set(10_000);
    poll(&c, &h, 0, &[3, 1]);
    let a = pd(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"text":"x","routed_dp_rank":5}"#,
        None,
        0,
    ));
    let b = pd(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"text":"x"}"#,
        None,
        1,
    ));
    assert_ne!(a.prefill.worker, b.prefill.worker);
    assert_eq!(a.prefill.rank, None);
    let p = json(&a.prefill_body);
    assert_eq!(
        p["routed_dp_rank"],
        serde_json::Value::Null,
        "client value neutralised"
    );
    assert_eq!(p["bootstrap_port"], serde_json::Value::Null);
    let d = json(&a.decode_body);
    assert_eq!(
        (d["routed_dp_rank"].as_u64(), d.get("disagg_prefill_dp_rank")),
        (Some(1), None)
    );
    assert_eq!(h.counter("dprank.passthrough.no_fresh_data_prefill"), 2);
}

#[test]
fn pd_rejects_bodies_it_cannot_extend() {
    let (c, h) = pd_fleet("");
    assert!(matches!(
        route(&c, &h, &mut StateCache::default(), b"not json", None, 0),
        Decision::Reject {
            reason: RejectReason::NotJson,
            reply: Reply { status: 400, .. }
        }
    ));
    assert!(matches!(
        route(&c, &h, &mut StateCache::default(), b"[1]", None, 0),
        Decision::Reject {
            reason: RejectReason::NotObject,
            reply: Reply { status: 400, .. }
        }
    ));
}

#[test]
fn pd_pin_names_both_sides() {
    let (c, h) = pd_fleet(r#","pin_header":"x-pin""#);
    let r = pd(route(
        &c,
        &h,
        &mut StateCache::default(),
        b"{}",
        Some("p1/0, d0/1"),
        0,
    ));
    assert_eq!((r.prefill.worker, r.prefill.rank), (3, Some(0)));
    assert_eq!(r.decode.map(|d| (d.worker, d.rank)), Some((0, Some(1))));
}

#[test]
fn server_priority_goes_into_both_legs() {
    let (c, h) = pd_fleet(r#","admission":{"server_priority":{"critical":7}}"#);
    let args = crate::router::RouteArgs {
        class: Some(0),
        ..crate::router::RouteArgs::default()
    };
    let d = super::super::route(
        &c,
        &h,
        &mut StateCache::default(),
        Input::Body(br#"{"text":"hello","priority":1}"#),
        &args,
    );
    let r = pd(d.unwrap());
    let (p, d) = (json(&r.prefill_body), json(&r.decode_body));
    assert_eq!(
        (p["priority"].as_i64(), d["priority"].as_i64()),
        (Some(7), Some(7))
    );
}
