//! The pipeline's stages one at a time: admission on the refreshed fleet,
//! choose, and the stages that write.

use super::*;
use crate::admission::Controller;
use crate::health::{Outcome, Target};
use crate::host::fake::FakeHost;
use crate::metrics;
use crate::router::outcome::PassReason;
use crate::router::snapshot::refresh;
use crate::scheduler::Candidate;
use crate::shared_data::testing::{fleet, pd_fleet};
use crate::shared_data::{self, cache::StateCache};
use crate::worker_state::saturation::Rule;

/// Stage `admission` on a fresh snapshot, for a request of `class`: the
/// rule the request is let in by, or the overload.
fn admitted(
    c: &Rc<Config>,
    h: &FakeHost,
    cache: &mut StateCache,
    class: Option<usize>,
) -> Result<Option<Rule>, Overloaded> {
    let mut snapshot = refresh(c, h, cache, 0);
    admit(h, &mut snapshot, class)?;
    Ok(snapshot.rule.map(|(_, rule)| rule))
}

/// Candidate ranks saturated for the default class now (the gauge).
fn saturated_ranks(c: &Rc<Config>, h: &FakeHost, cache: &mut StateCache) -> u64 {
    crate::router::overloaded_now(c, h, cache).1
}

#[test]
fn without_the_block_every_request_is_admitted_without_a_host_call() {
    let (c, h) = fleet("");
    let mut cache = StateCache::default();
    let mut snapshot = refresh(&c, &h, &mut cache, 0);
    let calls = h.total_host_calls();
    assert_eq!(admit(&h, &mut snapshot, None), Ok(()));
    assert_eq!(snapshot.rule, None);
    assert_eq!(h.total_host_calls(), calls);
}

#[test]
fn a_pool_is_overloaded_when_every_fresh_rank_waits_too_long() {
    // 8 ranks; each with about 100 tokens of own queue at 1 token/s.
    let (c, h) = fleet(r#","admission":{"max_wait_ms":50000,"prefill_tokens_per_s":1}"#);
    let mut cache = StateCache::default();
    assert!(
        matches!(admitted(&c, &h, &mut cache, None), Ok(Some(_))),
        "empty queues"
    );
    assert_eq!(saturated_ranks(&c, &h, &mut cache), 0);
    crate::shared_data::testing::queue_prefill(&c, &h, 100_000);
    let Err(o) = admitted(&c, &h, &mut cache, None) else {
        panic!("overloaded")
    };
    assert_eq!(o.saturated_ranks, 8);
    assert_eq!(o.retry_after_ms, 100_000 * 1000 - 50_000);
    assert!(
        admitted(&c, &h, &mut cache, Some(0)).is_err(),
        "critical waits twice as long: still too long"
    );
    assert_eq!(saturated_ranks(&c, &h, &mut cache), 8);
    // Stale data: nothing to judge, admitted and counted.
    h.now.set(10_000 + c.stale_after_ms + 1);
    assert_eq!(admitted(&c, &h, &mut cache, None), Ok(None));
    assert_eq!(h.counter(metrics::ADMISSION_NO_DATA), 1);
}

#[test]
fn a_rank_full_for_the_default_class_still_has_room_for_a_higher_one() {
    // Limits 16 (critical), 12 (standard), 8 (sheddable).
    let (c, h) = fleet(r#","admission":{"max_requests_per_rank":16}"#);
    let mut cache = StateCache::default();
    let running = |n: u64| {
        for i in 0..c.all_workers().count() {
            crate::shared_data::testing::report_on(&c, &h, i, &|_| crate::load::RankLoad {
                running_requests: Some(n),
                waiting_uncached_tokens: Some(0),
                ..crate::load::RankLoad::default()
            });
        }
    };
    let mut admits = |class| admitted(&c, &h, &mut cache, class).is_ok();
    running(12);
    assert!(!admits(None));
    assert!(!admits(Some(1)));
    assert!(admits(Some(0)), "critical may fill the rank");
    running(16);
    assert!(!admits(Some(0)));
    running(7);
    assert!(admits(Some(2)));
    running(8);
    assert!(!admits(Some(2)));
}

#[test]
fn pd_mode_judges_the_prefill_pool() {
    let (c, h) = pd_fleet(r#","admission":{"max_wait_ms":1000,"prefill_tokens_per_s":1}"#);
    let mut cache = StateCache::default();
    let snapshot = refresh(&c, &h, &mut cache, 0);
    assert_eq!(snapshot.judged_side(), Side::Prefill);
    let rule = Controller::new(c.admission.as_ref()).rule(None);
    assert_eq!(snapshot.candidate_queues(Side::Prefill, rule).count(), 4);
}

#[test]
fn an_overloaded_pool_chooses_nothing_and_writes_nothing() {
    let (c, h) = fleet(r#","admission":{"max_wait_ms":100,"prefill_tokens_per_s":1}"#);
    let mut cache = StateCache::default();
    let body = br#"{"text":"hi"}"#;
    let route = |cache: &mut StateCache| {
        crate::router::route(
            &c,
            &h,
            cache,
            crate::router::Input::Body(body),
            &RouteArgs::default(),
        )
    };
    assert!(route(&mut cache).is_ok(), "empty queues");
    crate::shared_data::testing::queue_prefill(&c, &h, 1000);
    let writes = h.host_calls("shared_set");
    let Err(overloaded) = route(&mut cache) else {
        panic!("overloaded")
    };
    assert_eq!(overloaded.saturated_ranks, 8);
    assert_eq!(h.host_calls("shared_set"), writes);
    assert!(h.counters.borrow().keys().all(|k| !k.contains("rejected")));
}

fn leg(pin: Option<&str>, alternates: usize) -> Leg<'_> {
    Leg {
        side: Side::Forward,
        constraint: Constraint { only_rank: None, pin },
        alternates,
    }
}

/// Fails worker `i` of `c` once at `at` (ejecting it under one failure).
fn eject(c: &Config, h: &FakeHost, i: usize, at: u64) {
    let t = Target {
        worker: c.routed()[i].address,
        rank: None,
    };
    crate::health_updates::record(c, h, &[(t, Outcome::Failure)], at, false);
}

#[test]
fn choose_drops_a_pin_naming_nobody_and_counts_it() {
    let (c, h) = fleet(r#","prefix_affinity":false"#);
    let mut cache = StateCache::default();
    let snapshot = refresh(&c, &h, &mut cache, 0);
    let pinned = choose(&h, &snapshot, &leg(Some("a/3"), 1), None).unwrap();
    assert_eq!(
        (pinned.chosen.worker, pinned.chosen.rank, pinned.chosen.cost),
        (0, 3, 100)
    );
    assert_eq!(h.counter(metrics::PIN_IGNORED), 0);
    let dropped = choose(&h, &snapshot, &leg(Some("zz/0"), 1), None).unwrap();
    assert_eq!(
        (dropped.chosen.worker, dropped.chosen.rank),
        (1, 2),
        "the least loaded"
    );
    assert_eq!(h.counter(metrics::PIN_IGNORED), 1);
    assert_eq!(
        (dropped.found.len(), dropped.found[0].worker, dropped.wanted),
        (1, 0, 1),
        "a's rank 2 is the alternate"
    );
}

#[test]
fn with_nobody_in_rotation_choose_takes_a_worker_past_its_cooldown() {
    let (c, h) =
        fleet(r#","passive_health":{"consecutive_failures":1,"cooldown_ms":100,"probe_share":0.000001}"#);
    eject(&c, &h, 0, 10_000);
    eject(&c, &h, 1, 10_000);
    let mut cache = StateCache::default();
    let snapshot = refresh(&c, &h, &mut cache, 0);
    assert_eq!(
        choose(&h, &snapshot, &leg(None, 0), None),
        None,
        "both cooling down"
    );
    assert_eq!(
        no_candidate_reason(&snapshot, Side::Forward),
        PassReason::NoneInRotation
    );
    h.now.set(10_200);
    let snapshot = refresh(&c, &h, &mut cache, 0);
    assert!(!snapshot.admit_probing, "not a probe by draw");
    let probe = choose(&h, &snapshot, &leg(None, 0), None).unwrap();
    assert_eq!((probe.chosen.worker, probe.chosen.rank), (1, 2));
}

#[test]
fn no_candidate_reason_tells_stale_data_from_ejections() {
    let (c, h) = fleet("");
    h.now.set(10_000 + c.stale_after_ms + 1);
    let mut cache = StateCache::default();
    let snapshot = refresh(&c, &h, &mut cache, 0);
    assert_eq!(
        no_candidate_reason(&snapshot, Side::Forward),
        PassReason::NoFreshData
    );
}

#[test]
fn commit_lists_the_alternates_writes_the_estimate_and_counts_the_route() {
    let (c, h) = fleet(r#","prefix_affinity":false"#);
    let mut cache = StateCache::default();
    let snapshot = refresh(&c, &h, &mut cache, 0);
    let choice = choose(&h, &snapshot, &leg(None, 2), None).unwrap();
    let committed = commit(&c, &h, &mut cache, &choice, 30, None, None);
    assert_eq!(
        (
            committed.chosen.worker,
            committed.chosen.rank,
            committed.chosen.endpoint.as_ref()
        ),
        (1, Some(2), "127.0.0.1:2")
    );
    assert_eq!(committed.alternates.len(), 1);
    assert_eq!(committed.alternates[0].endpoint.as_ref(), "127.0.0.1:1");
    assert_eq!(committed.estimate.map(|t| t.cost), Some(30));
    assert!(committed.queued_prefill.is_none());
    assert_eq!(
        cache.states()[1].as_ref().unwrap().effective_tokens(2),
        Some(20 + 30)
    );
    assert_eq!(h.counter("dprank.routed.b.rank_2"), 1);
    assert_eq!(h.counter(metrics::NO_ALTERNATE), 0);
}

#[test]
fn retry_targets_count_a_leg_left_without_the_alternates_it_asked_for() {
    let cache = StateCache::default();
    let h = FakeHost::default();
    let choice = |wanted| Choice {
        chosen: Candidate {
            worker: 0,
            rank: 0,
            cost: 0,
        },
        found: Vec::new(),
        wanted,
        pool_offset: 0,
    };
    assert!(retry_targets(&h, &cache, &choice(0)).is_empty());
    assert_eq!(h.counter(metrics::NO_ALTERNATE), 0, "none asked for");
    assert!(retry_targets(&h, &cache, &choice(2)).is_empty());
    assert_eq!(h.counter(metrics::NO_ALTERNATE), 1);
}

#[test]
fn account_skips_a_worker_without_state_but_counts_the_route() {
    let (c, h) = fleet("");
    let mut cache = StateCache::default();
    cache.refresh(&c, &h);
    let beyond = Candidate {
        worker: 0,
        rank: 9,
        cost: 0,
    };
    assert_eq!(account(&c, &h, &mut cache, &beyond, 5, None), (None, None));
    assert_eq!(h.counter(metrics::ACCOUNTING_SKIPPED), 1, "rank 9 does not exist");
    assert_eq!(h.counter("dprank.routed.a.rank_9"), 1);
}

#[test]
fn record_writes_the_prompt_under_the_cas_read_for_the_choice() {
    let (c, h) = fleet("");
    let mut cache = StateCache::default();
    let body = format!(r#"{{"text":"{}","stream":true}}"#, "r".repeat(3000));
    let object = crate::body::JsonObject::parse(body.as_bytes()).unwrap();
    let snapshot = refresh(&c, &h, &mut cache, 0);
    let mut prefix = crate::router::body_fields::prefix_request(&c, &object, snapshot.now_ms).unwrap();
    let choice = choose(&h, &snapshot, &leg(None, 0), Some(&mut prefix)).unwrap();
    assert_eq!(
        prefix.cached(choice.chosen.worker, choice.chosen.rank as usize),
        0
    );
    let (reads, writes) = (h.host_calls("shared_get"), h.host_calls("shared_set"));
    record(&c, &h, &mut prefix, &cache, 0, &choice.chosen);
    assert_eq!(
        (
            h.host_calls("shared_get") - reads,
            h.host_calls("shared_set") - writes
        ),
        (0, 1),
        "one write, no read"
    );
    let mut again = crate::router::body_fields::prefix_request(&c, &object, h.now.get()).unwrap();
    let at = choice.chosen;
    again.insert(at.worker, shared_data::read_prefix_index(&c, &h, at.worker));
    assert_eq!(
        again.cached(at.worker, at.rank as usize),
        640,
        "the prompt's 5 whole blocks of 128 tokens are held there now"
    );
}
