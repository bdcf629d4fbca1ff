//! The passive health state machine, outcome classification and attribution.

use super::*;

fn policy() -> PassiveHealth {
    PassiveHealth {
        consecutive_failures: 3,
        cooldown_ms: 1000,
        max_cooldown_ms: 4000,
        probe_share: 0.05,
    }
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 1], port))
}

fn worker(port: u16) -> Target {
    Target {
        worker: addr(port),
        rank: None,
    }
}

fn rank(port: u16, r: u32) -> Target {
    Target {
        worker: addr(port),
        rank: Some(r),
    }
}

/// `n` failures of requests routed and ended at `at`.
fn fail(h: &mut Health, t: Target, n: u32, at: u64) -> Option<Change> {
    let mut last = None;
    for _ in 0..n {
        last = h.observe(&policy(), t, Outcome::Failure, at, at);
    }
    last
}

fn admitted(h: &Health, port: u16, now: u64, probing: bool) -> bool {
    h.admitted(addr(port), now, probing).is_some()
}

#[test]
fn consecutive_failures_eject_and_a_success_in_between_resets_the_count() {
    let mut h = Health::default();
    assert_eq!(
        fail(&mut h, worker(1), 2, 100),
        Some(Change::Counted { failures: 2 })
    );
    assert!(admitted(&h, 1, 100, false), "two failures: still in rotation");
    assert_eq!(
        h.observe(&policy(), worker(1), Outcome::Success, 100, 110),
        Some(Change::Cleared)
    );
    assert!(h.entries.is_empty(), "cleared: nothing to keep");
    assert_eq!(
        fail(&mut h, worker(1), 2, 200),
        Some(Change::Counted { failures: 2 })
    );
    assert_eq!(
        fail(&mut h, worker(1), 1, 300),
        Some(Change::Ejected {
            cooldown_ms: 1000,
            ejections: 1
        })
    );
    assert!(!admitted(&h, 1, 300, false));
    assert!(!admitted(&h, 1, 1299, true), "no probe before the cooldown ends");
    assert!(admitted(&h, 2, 300, false), "another worker is not touched");
}

#[test]
fn client_errors_and_429_do_not_count() {
    let mut h = Health::default();
    fail(&mut h, worker(1), 2, 100);
    for code in [400, 404, 413, 422] {
        let o = classify(Some(code), Some("via_upstream"));
        assert_eq!(o, Outcome::Success, "{code}: the worker is up");
    }
    assert_eq!(classify(Some(429), Some("via_upstream")), Outcome::Neutral);
    // A 429 neither clears the count nor adds to it.
    assert_eq!(h.observe(&policy(), worker(1), Outcome::Neutral, 100, 110), None);
    assert_eq!(h.entry(&worker(1)).map(|e| e.failures), Some(2));
    // 400 "rank out of range" over and over never ejects.
    let mut h = Health::default();
    for _ in 0..50 {
        let o = classify(Some(400), Some("via_upstream"));
        h.observe(&policy(), rank(1, 3), o, 100, 100);
        h.observe(&policy(), worker(1), o, 100, 100);
    }
    assert!(h.entries.is_empty());
}

#[test]
fn after_the_cooldown_only_probes_go_and_a_successful_probe_returns_the_worker() {
    let mut h = Health::default();
    fail(&mut h, worker(1), 3, 1000); // ejected until 2000
    assert_eq!(h.standing(addr(1), 1500), Standing::Ejected);
    assert!(!h.any_probing(1999));
    assert!(h.any_probing(2000));
    assert_eq!(h.standing(addr(1), 2000), Standing::Probing);
    assert!(!admitted(&h, 1, 2000, false), "not for ordinary requests");
    assert!(admitted(&h, 1, 2000, true), "for probes");
    // A request routed before probing began cannot bring it back.
    assert_eq!(
        h.observe(&policy(), worker(1), Outcome::Success, 1500, 2100),
        None
    );
    assert_eq!(
        h.observe(&policy(), worker(1), Outcome::Success, 2050, 2100),
        Some(Change::Returned)
    );
    assert_eq!(h.standing(addr(1), 2100), Standing::InRotation);
    assert!(admitted(&h, 1, 2100, false));
    // A failure of a request routed while it was out does not count again.
    assert_eq!(
        h.observe(&policy(), worker(1), Outcome::Failure, 1900, 2200),
        None
    );
}

#[test]
fn failed_probes_double_the_cooldown_up_to_the_cap_and_a_long_healthy_spell_forgives() {
    let p = policy();
    let mut h = Health::default();
    let mut now = 1000;
    fail(&mut h, worker(1), 3, now);
    let mut cooldowns = vec![];
    for _ in 0..5 {
        let e = *h.entry(&worker(1)).unwrap();
        cooldowns.push(e.probe_from_ms - e.ejected_at_ms);
        now = e.probe_from_ms;
        // While ejected, nothing a request says changes anything.
        assert_eq!(h.observe(&p, worker(1), Outcome::Failure, now - 1, now - 1), None);
        assert_eq!(h.observe(&p, worker(1), Outcome::Success, now - 1, now - 1), None);
        let probe = h.observe(&p, worker(1), Outcome::Failure, now, now);
        assert!(matches!(probe, Some(Change::Ejected { .. })), "{probe:?}");
    }
    assert_eq!(cooldowns, vec![1000, 2000, 4000, 4000, 4000]);
    assert_eq!(cooldown(&p, 40), 4000, "no overflow");
    // Back, then ejected again soon: the cooldown keeps growing.
    now = h.entry(&worker(1)).unwrap().probe_from_ms;
    h.observe(&p, worker(1), Outcome::Success, now, now);
    let again = fail(&mut h, worker(1), 3, now + 10);
    assert_eq!(
        again,
        Some(Change::Ejected {
            cooldown_ms: 4000,
            ejections: 7
        })
    );
    // Back, healthy for max_cooldown: forgiven, and the entry goes.
    now = h.entry(&worker(1)).unwrap().probe_from_ms;
    h.observe(&p, worker(1), Outcome::Success, now, now);
    assert!(!h.prune(Some(&p), now + 3999, |_| true), "not yet");
    assert!(h.prune(Some(&p), now + 4000, |_| true));
    assert!(h.entries.is_empty());
    assert_eq!(
        fail(&mut h, worker(1), 3, now + 5000),
        Some(Change::Ejected {
            cooldown_ms: 1000,
            ejections: 1
        })
    );
}

#[test]
fn a_failing_rank_leaves_alone_while_the_worker_stays() {
    let mut h = Health::default();
    // Rank 2 fails; ranks 0 and 1 answer in between: the worker's count resets.
    for i in 0..3 {
        h.observe(&policy(), worker(1), Outcome::Failure, i, i);
        h.observe(&policy(), rank(1, 2), Outcome::Failure, i, i);
        h.observe(&policy(), worker(1), Outcome::Success, i, i);
    }
    let ranks_out = |now, probing| h.admitted(addr(1), now, probing).map(Iterator::collect::<Vec<_>>);
    assert_eq!(ranks_out(10, false), Some(vec![2]));
    assert_eq!(h.standing(addr(1), 10), Standing::InRotation);
    assert_eq!(ranks_out(1010, true), Some(vec![]), "rank 2 may be probed");
}

#[test]
fn pruning_drops_workers_no_longer_configured_and_everything_when_off() {
    let mut h = Health::default();
    fail(&mut h, worker(1), 3, 100);
    fail(&mut h, worker(2), 1, 100);
    assert!(h.prune(Some(&policy()), 200, |a| *a == addr(1)));
    assert_eq!(h.entries.len(), 1);
    assert!(h.prune(None, 200, |_| true), "passive health off: nothing kept");
    assert!(h.entries.is_empty());
}

#[test]
fn the_probe_share_is_about_the_configured_share_of_requests() {
    for share in [0.01, 0.05, 0.5] {
        let probes = (0..100_000u64).filter(|t| is_probe(share, *t)).count() as f64;
        let expected = share * 100_000.0;
        assert!(
            (probes - expected).abs() < expected * 0.1 + 30.0,
            "{share}: {probes}"
        );
    }
    assert!((0..1000u64).all(|t| is_probe(1.0, t)));
}

#[test]
fn classification_of_envoy_code_details() {
    let c = |code, details| classify(code, Some(details));
    assert_eq!(c(Some(200), "via_upstream"), Outcome::Success);
    assert_eq!(c(Some(503), "via_upstream"), Outcome::Failure);
    assert_eq!(
        c(
            Some(503),
            "upstream_reset_before_response_started{connection_failure,delayed_connect_error:_Connection_refused}"
        ),
        Outcome::Unreachable
    );
    assert_eq!(
        c(
            Some(503),
            "upstream_reset_before_response_started{connection_termination}"
        ),
        Outcome::Unreachable
    );
    assert_eq!(
        c(Some(200), "upstream_reset_after_response_started{protocol_error}"),
        Outcome::Failure
    );
    assert_eq!(
        c(Some(503), "upstream_reset_before_response_started{overflow}"),
        Outcome::Neutral,
        "Envoy's own circuit breaker"
    );
    assert_eq!(
        c(Some(200), "upstream_reset_after_response_started{local_reset}"),
        Outcome::Neutral,
        "the client left"
    );
    assert_eq!(c(Some(504), "upstream_response_timeout"), Outcome::Failure);
    assert_eq!(c(Some(503), "no_healthy_upstream"), Outcome::Neutral);
    assert_eq!(c(None, "downstream_remote_disconnect"), Outcome::Neutral);
    assert_eq!(classify(Some(400), None), Outcome::Neutral, "dprank's own reply");
}

#[test]
fn a_worker_ejected_for_being_unreachable_is_probed_once_a_poll_reaches_it() {
    let p = policy();
    let mut h = Health::default();
    for _ in 0..3 {
        h.observe(&p, worker(1), Outcome::Unreachable, 100, 100);
        h.observe(&p, worker(2), Outcome::Failure, 100, 100);
    }
    assert!(!admitted(&h, 1, 200, true) && !admitted(&h, 2, 200, true));
    assert!(h.poll_answered(addr(1), 200));
    assert!(!h.poll_answered(addr(1), 210), "already probing");
    assert!(admitted(&h, 1, 200, true), "probed at once");
    assert!(
        !h.poll_answered(addr(2), 200),
        "a worker ejected for its answers waits out its cooldown: its polls succeed anyway"
    );
    assert!(!admitted(&h, 2, 200, true));
    assert!(!h.poll_answered(addr(3), 200), "no entry");
    // A probe that fails for its answer makes the next ejection wait...
    h.observe(&p, worker(1), Outcome::Failure, 300, 300);
    assert!(!h.poll_answered(addr(1), 400));
    // ...unless a poll then finds nobody there (a worker killed mid-stream:
    // ejected for the streams it broke, then gone).
    assert!(h.poll_unanswered(addr(1), 500));
    assert!(!h.poll_unanswered(addr(1), 600), "once");
    assert!(h.poll_answered(addr(1), 700), "restarted: probed at once");
    assert!(admitted(&h, 1, 700, true));
    assert!(!h.poll_unanswered(addr(3), 700), "no entry: nothing to do");
}

#[test]
fn outcomes_go_to_the_host_that_served_each_attempt() {
    let hosts = [addr(1), addr(2), addr(3)];
    let done = |code, details: &str, upstream: Option<u16>, attempts| Finished {
        code: Some(code),
        details: Some(details.into()),
        upstream: upstream.map(addr),
        attempts: Some(attempts),
    };
    // Served by the chosen worker at the first attempt.
    assert_eq!(
        outcomes(&done(200, "via_upstream", Some(1), 1), &hosts, Some(3)),
        vec![(worker(1), Outcome::Success), (rank(1, 3), Outcome::Success)]
    );
    // The chosen worker refused the connection; the first alternate answered 500.
    assert_eq!(
        outcomes(&done(500, "via_upstream", Some(2), 2), &hosts, Some(3)),
        vec![
            (worker(1), Outcome::Unreachable),
            (worker(2), Outcome::Failure),
            (rank(2, 3), Outcome::Failure)
        ]
    );
    // Every listed host failed; the fallback policy picked another one.
    let fallback = outcomes(&done(400, "via_upstream", Some(9), 3), &hosts[..2], Some(3));
    assert_eq!(
        fallback,
        vec![
            (worker(1), Outcome::Unreachable),
            (worker(2), Outcome::Unreachable),
            (worker(9), Outcome::Success),
            (rank(9, 3), Outcome::Success)
        ]
    );
    // Connection refused on the last attempt: the worker's failure, not the rank's.
    let refused = "upstream_reset_before_response_started{connection_failure}";
    assert_eq!(
        outcomes(&done(503, refused, Some(1), 1), &hosts, Some(0)),
        vec![(worker(1), Outcome::Unreachable)]
    );
    // No host list (the fallback policy picked): only the final host.
    assert_eq!(
        outcomes(&done(502, "via_upstream", Some(4), 1), &[], None),
        vec![(worker(4), Outcome::Failure)]
    );
    // dprank answered itself: nothing.
    assert!(outcomes(&done(400, "wasm_fail_stream", None, 1), &hosts, Some(1)).is_empty());
    assert!(outcomes(&Finished::default(), &hosts, Some(1)).is_empty());
}
