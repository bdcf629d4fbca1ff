use super::*;
use crate::host::fake::FakeHost;
use crate::shared_data::cache::StateCache;
use crate::shared_data::testing::*;

/// Routes `body` through the real entry as a request of the default
/// class (`pin` the test pin, `tie_breaker` its draw); admission, when
/// configured, lets it in.
fn route(
    c: &Rc<Config>,
    h: &dyn Host,
    cache: &mut StateCache,
    body: &[u8],
    pin: Option<&str>,
    tie_breaker: u64,
) -> Decision {
    route_with(
        c,
        h,
        cache,
        body,
        &RouteArgs {
            pin,
            tie_breaker,
            class: None,
        },
    )
    .expect("let in")
}

/// `route`, with the request's `args`; Err: admission keeps it out.
fn route_with(
    c: &Rc<Config>,
    h: &dyn Host,
    cache: &mut StateCache,
    body: &[u8],
    args: &RouteArgs,
) -> Result<Decision, Overloaded> {
    super::route(c, h, cache, Input::Body(body), args)
}

fn routed(d: Decision) -> Routed {
    match d {
        Decision::Route(r) => r,
        other => panic!("expected a route, got {other:?}"),
    }
}

#[test]
fn routes_to_the_joint_minimum_and_injects_the_rank() {
    let (c, h) = fleet("");
    let r = routed(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"text":"hi"}"#,
        None,
        0,
    ));
    assert_eq!(
        (r.chosen.worker, r.chosen.rank, r.chosen.endpoint.as_ref()),
        (1, Some(2), "127.0.0.1:2")
    );
    assert_eq!(r.body.unwrap(), br#"{"routed_dp_rank":2,"text":"hi"}"#);
    assert_eq!(h.counter("dprank.routed.b.rank_2"), 1);
}

#[test]
fn estimates_spread_a_burst_between_polls() {
    let (c, h) = fleet(r#","prefix_affinity":false"#);
    let prompt = format!(r#"{{"text":"{}"}}"#, "x".repeat(4 * 40)); // 40 tokens
    let picks: Vec<(usize, Option<u32>)> = (0..3)
        .map(|i| {
            let r = routed(route(
                &c,
                &h,
                &mut StateCache::default(),
                prompt.as_bytes(),
                None,
                i,
            ));
            (r.chosen.worker, r.chosen.rank)
        })
        .collect();
    // 20 -> 60 after the first, so the second goes to the 50-token rank.
    assert_eq!(picks, vec![(1, Some(2)), (0, Some(1)), (1, Some(2))]);
}

#[test]
fn accounting_survives_concurrent_writers() {
    let (c, h) = fleet("");
    h.conflicts.set(3);
    let r = routed(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"text":"hi"}"#,
        None,
        0,
    ));
    assert!(r.estimate.is_some());
    h.conflicts.set(1000);
    let r = routed(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"text":"hi"}"#,
        None,
        0,
    ));
    assert!(r.estimate.is_none(), "routing goes on without accounting");
    assert_eq!(h.counter("dprank.accounting_skipped"), 1);
}

#[test]
fn client_rank_fields_are_overwritten_by_default() {
    let (c, h) = fleet("");
    let r = routed(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"data_parallel_rank":0,"routed_dp_rank":3,"text":"x"}"#,
        None,
        0,
    ));
    assert_eq!(
        r.body.unwrap(),
        br#"{"data_parallel_rank":null,"routed_dp_rank":2,"text":"x"}"#
    );
}

#[test]
fn trusted_client_rank_keeps_the_body_and_picks_the_worker() {
    let (c, h) = fleet(r#","keep_client_rank":true"#);
    let r = routed(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"routed_dp_rank":1,"text":"x"}"#,
        None,
        0,
    ));
    assert_eq!((r.chosen.worker, r.chosen.rank, r.body), (0, Some(1), None));
    // Not an integer: ignored, routed normally.
    let r = routed(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"routed_dp_rank":"1","text":"x"}"#,
        None,
        0,
    ));
    assert_eq!((r.chosen.worker, r.chosen.rank), (1, Some(2)));
}

#[test]
fn no_fresh_data_passes_through_and_neutralises_client_ranks() {
    let c = config("");
    let h = FakeHost::default();
    assert_eq!(
        route(&c, &h, &mut StateCache::default(), br#"{"text":"x"}"#, None, 0),
        Decision::PassThrough {
            reason: PassReason::NoFreshData,
            body: None
        }
    );
    let d = route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"routed_dp_rank":1,"text":"x"}"#,
        None,
        0,
    );
    assert_eq!(
        d,
        Decision::PassThrough {
            reason: PassReason::NoFreshData,
            body: Some(br#"{"routed_dp_rank":null,"text":"x"}"#.to_vec())
        }
    );
    assert_eq!(h.counter("dprank.passthrough.no_fresh_data"), 2);
}

#[test]
fn stale_data_counts_as_none() {
    let (c, h) = fleet("");
    h.now.set(10_000 + c.stale_after_ms + 1);
    assert!(matches!(
        route(&c, &h, &mut StateCache::default(), b"{}", None, 0),
        Decision::PassThrough { .. }
    ));
}

#[test]
fn fail_closed_rejects_with_json_errors() {
    let c = config(r#","fail_mode":"closed""#);
    let h = FakeHost::default();
    match route(&c, &h, &mut StateCache::default(), b"{}", None, 0) {
        Decision::Reject {
            reason: RejectReason::NoFreshData,
            reply: Reply { status, body, .. },
        } => {
            assert_eq!(status, 503);
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert!(v["error"]["message"].as_str().unwrap().contains("fresh"));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        route(&c, &h, &mut StateCache::default(), b"[1]", None, 0),
        Decision::Reject {
            reason: RejectReason::NotObject,
            reply: Reply { status: 400, .. }
        }
    ));
    assert_eq!(h.counter("dprank.rejected.not_object"), 1);
}

#[test]
fn bad_bodies_pass_through_in_open_mode() {
    let (c, h) = fleet("");
    for (body, reason) in [
        (&b"nope"[..], PassReason::NotJson),
        (b"[]", PassReason::NotObject),
    ] {
        assert_eq!(
            route(&c, &h, &mut StateCache::default(), body, None, 0),
            Decision::PassThrough { reason, body: None }
        );
    }
    assert_eq!(h.counter("dprank.passthrough.not_json"), 1);
}

#[test]
fn pin_header_overrides_when_it_names_a_candidate() {
    let (c, h) = fleet(r#","pin_header":"x-dprank-pin""#);
    let r = routed(route(&c, &h, &mut StateCache::default(), b"{}", Some("a/3"), 0));
    assert_eq!((r.chosen.worker, r.chosen.rank), (0, Some(3)));
    let r = routed(route(&c, &h, &mut StateCache::default(), b"{}", Some("a/9"), 0));
    assert_eq!((r.chosen.worker, r.chosen.rank), (1, Some(2)));
    assert_eq!(h.counter("dprank.pin_ignored"), 1);
}

#[test]
fn legacy_naming_injects_data_parallel_rank() {
    let (c, h) = fleet(r#","naming":"legacy""#);
    let r = routed(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"prompt":"x"}"#,
        None,
        0,
    ));
    assert_eq!(r.body.unwrap(), br#"{"data_parallel_rank":2,"prompt":"x"}"#);
}

#[test]
fn a_trusted_rank_nobody_has_is_told_apart_from_no_data() {
    let (c, h) = fleet(r#","keep_client_rank":true"#);
    let d = route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"routed_dp_rank":7}"#,
        None,
        0,
    );
    assert_eq!(
        d,
        Decision::PassThrough {
            reason: PassReason::ClientRankUnavailable,
            body: None
        }
    );
    assert_eq!(h.counter("dprank.passthrough.client_rank_unavailable"), 1);
    let (c, h) = fleet(r#","keep_client_rank":true,"fail_mode":"closed""#);
    assert!(matches!(
        route(
            &c,
            &h,
            &mut StateCache::default(),
            br#"{"routed_dp_rank":7}"#,
            None,
            0
        ),
        Decision::Reject {
            reason: RejectReason::ClientRankUnavailable,
            reply: Reply { status: 400, .. }
        }
    ));
}

#[test]
fn an_empty_body_passes_through_as_empty() {
    let (c, h) = fleet(r#","fail_mode":"closed""#);
    assert_eq!(
        route(&c, &h, &mut StateCache::default(), b"", None, 0),
        Decision::PassThrough {
            reason: PassReason::EmptyBody,
            body: None
        }
    );
    assert_eq!(h.counter("dprank.passthrough.empty_body"), 1);
}

#[test]
fn unreadable_bodies_naming_a_rank_are_refused_unless_clients_are_trusted() {
    let (c, h) = fleet("");
    let nan = br#"{"text":"x","routed_dp_rank":3,"temperature":NaN}"#;
    assert!(matches!(
        route(&c, &h, &mut StateCache::default(), nan, None, 0),
        Decision::Reject {
            reason: RejectReason::UnreadableRank,
            reply: Reply { status: 400, .. }
        }
    ));
    assert_eq!(h.counter("dprank.rejected.unreadable_rank"), 1);
    assert!(matches!(
        route(&c, &h, &mut StateCache::default(), b"text=hi", None, 0),
        Decision::PassThrough {
            reason: PassReason::NotJson,
            ..
        }
    ));
    let (c, h) = fleet(r#","keep_client_rank":true"#);
    assert!(matches!(
        route(&c, &h, &mut StateCache::default(), nan, None, 0),
        Decision::PassThrough {
            reason: PassReason::NotJson,
            ..
        }
    ));
}

#[test]
fn the_reply_of_a_routed_leg_carries_its_tickets_and_moment() {
    let to = Chosen {
        worker: 1,
        rank: Some(2),
        value: Some(2),
        endpoint: "127.0.0.1:2".into(),
    };
    let ticket = crate::worker_state::Ticket {
        worker: 1,
        rank: 2,
        seq: 4,
        cost: 9,
    };
    let committed = pipeline::Committed {
        chosen: to.clone(),
        alternates: vec![],
        estimate: Some(ticket),
        queued_prefill: None,
    };
    let moment = snapshot::Moment {
        routed_at_ms: 77,
        health_was_clean: false,
    };
    let r = Routed::new(committed, moment, Some(b"{}".to_vec()));
    assert_eq!(
        (r.chosen, r.estimate, r.body.as_deref()),
        (to, Some(ticket), Some(&b"{}"[..]))
    );
    assert_eq!((r.routed_at_ms, r.health_was_clean), (77, false));
}

#[test]
fn admission_sends_a_request_it_lets_in_to_a_rank_with_room() {
    // Fewest tokens: b/2 (20 tokens), then a/1 (50). b/2's queue of 2000
    // prompt tokens at 1000 tokens/s is 2 s of wait, past 500 ms: with
    // admission on, the request goes to a/1, which has room.
    let admission = r#","prefix_affinity":false,"admission":{"max_wait_ms":500,"prefill_tokens_per_s":1000,"learn_drain_rate":false}"#;
    let pick = |extra: &str, queued: bool| {
        let (c, h) = fleet(extra);
        if queued {
            queue_prefill_on(&c, &h, 0, &|_| 0);
            queue_prefill_on(&c, &h, 1, &|r| if r == 2 { 2000 } else { 0 });
        }
        let r = routed(route(
            &c,
            &h,
            &mut StateCache::default(),
            br#"{"text":"hi"}"#,
            None,
            0,
        ));
        (r.chosen.worker, r.chosen.rank)
    };
    assert_eq!(
        pick(r#","prefix_affinity":false"#, false),
        (1, Some(2)),
        "without admission"
    );
    assert_eq!(pick(admission, false), (1, Some(2)), "every rank has room");
    assert_eq!(pick(admission, true), (0, Some(1)), "b/2 has no room");
}

#[test]
fn admission_lets_a_long_prompt_onto_an_idle_rank() {
    // 10,000 prompt tokens take 10 s to prefill at 1000 tokens/s, far past
    // the 500 ms limit: the limit is on the wait before its prefill starts,
    // and on an idle fleet nothing is ahead of it.
    let (c, h) = fleet(
        r#","prefix_affinity":false,"admission":{"max_wait_ms":500,"prefill_tokens_per_s":1000,"learn_drain_rate":false}"#,
    );
    queue_prefill(&c, &h, 0);
    let body = format!(r#"{{"text":"{}"}}"#, "x".repeat(4 * 10_000));
    let r = routed(route(
        &c,
        &h,
        &mut StateCache::default(),
        body.as_bytes(),
        None,
        0,
    ));
    assert_eq!((r.chosen.worker, r.chosen.rank), (1, Some(2)));
}

#[test]
fn admission_caps_the_requests_on_a_rank() {
    // Every rank reports 4 requests running; b/2 (fewest tokens) 8: with
    // at most 8 requests per rank it has no room and a/1 is chosen; with
    // every rank at 8, the pool is saturated.
    let capped = r#","prefix_affinity":false,"admission":{"max_requests_per_rank":8}"#;
    let (c, h) = fleet(capped);
    let running = |c: &Config, h: &FakeHost, i: usize, n: &dyn Fn(usize) -> u64| {
        crate::shared_data::testing::report_on(c, h, i, &|r| crate::load::RankLoad {
            running_requests: Some(n(r)),
            waiting_uncached_tokens: Some(0),
            waiting_requests: Some(0),
            ..crate::load::RankLoad::default()
        })
    };
    running(&c, &h, 0, &|_| 4);
    running(&c, &h, 1, &|r| if r == 2 { 8 } else { 4 });
    let r = routed(route(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"text":"hi"}"#,
        None,
        0,
    ));
    assert_eq!((r.chosen.worker, r.chosen.rank), (0, Some(1)));
    running(&c, &h, 0, &|_| 8);
    running(&c, &h, 1, &|_| 8);
    let d = route_with(
        &c,
        &h,
        &mut StateCache::default(),
        br#"{"text":"hi"}"#,
        &RouteArgs::default(),
    );
    assert!(d.is_err(), "overloaded: {d:?}");
}

#[test]
fn server_priority_goes_into_the_routed_body_by_class() {
    let with_args = |extra: &str, body: &[u8], class: Option<usize>| {
        let (c, h) = fleet(extra);
        let args = RouteArgs {
            class,
            ..RouteArgs::default()
        };
        routed(route_with(&c, &h, &mut StateCache::default(), body, &args).unwrap()).body
    };
    let on = r#","admission":{"server_priority":{"critical":1,"sheddable":-1}}"#;
    assert_eq!(
        with_args(on, br#"{"text":"hi"}"#, Some(0)).unwrap(),
        br#"{"routed_dp_rank":2,"priority":1,"text":"hi"}"#
    );
    assert_eq!(
        with_args(on, br#"{"priority":99,"text":"hi"}"#, Some(2)).unwrap(),
        br#"{"routed_dp_rank":2,"priority":-1,"text":"hi"}"#,
        "the client's own is overwritten"
    );
    assert_eq!(
        with_args(on, br#"{"priority":99,"text":"hi"}"#, None).unwrap(),
        br#"{"routed_dp_rank":2,"priority":null,"text":"hi"}"#,
        "the default class has no value: the client's is nulled"
    );
    assert_eq!(
        with_args(r#","admission":{}"#, br#"{"priority":99,"text":"hi"}"#, Some(0)).unwrap(),
        br#"{"routed_dp_rank":2,"priority":99,"text":"hi"}"#,
        "off: left alone"
    );
    let trusted = r#","keep_client_rank":true,"admission":{"server_priority":{"critical":1}}"#;
    assert_eq!(
        with_args(trusted, br#"{"routed_dp_rank":1,"text":"x"}"#, Some(0)).unwrap(),
        br#"{"priority":1,"routed_dp_rank":1,"text":"x"}"#,
        "a trusted client's rank stays, the priority is written"
    );
}
