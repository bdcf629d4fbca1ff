//! Stage `admission`: whether a request is let in now, decided after
//! `refresh` (on the fleet as the request sees it, and the clock) and
//! before anything is chosen, on every path (body mode, header mode, PD,
//! where the prefill pool is judged). With `admission` configured, a pool
//! whose every candidate rank is saturated (`wait.rs`) is overloaded: the
//! router then chooses nothing and says so, and the request lifecycle
//! refuses the request or holds it, by its class (docs/overload.md).

pub mod queue;

use super::snapshot::{Side, Snapshot};
use crate::config::Admission as Settings;
use crate::host::Host;
use crate::metrics;
use crate::worker_state::saturation::{self as wait, Judgement, Limits, Room};
use crate::worker_state::RankQueue;

/// Every candidate of the pool is saturated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overload {
    /// How long until the least saturated rank has room, as far as known.
    pub retry_after_ms: u64,
    /// Candidate ranks judged (all saturated).
    pub saturated_ranks: u32,
}

/// What admission decided.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Admission {
    /// Go on and choose; with a rule, among the judged pool's ranks that
    /// have room by it (None: no admission, or nothing to judge).
    Admit(Option<Room>),
    /// Choose nothing: the lifecycle refuses or holds the request.
    Overloaded(Overload),
}

/// The pool admission judges: PD's prefill pool (where requests queue
/// before their first token), else the routed one.
pub(crate) fn judged_side(snapshot: &Snapshot) -> Side {
    match snapshot.config.pd() {
        Some(_) => Side::Prefill,
        None => Side::Routed,
    }
}

/// The queues of the ranks a request could be sent to: fresh workers in
/// rotation (no probes), ranks with a known load and not ejected.
pub(crate) fn candidate_queues<'s>(
    snapshot: &'s Snapshot,
    settings: &'s Settings,
) -> impl Iterator<Item = RankQueue> + 's {
    let pool = snapshot.pool(judged_side(snapshot));
    let (now, stale) = (snapshot.now_ms, snapshot.config.stale_after_ms);
    let health = snapshot.health();
    pool.workers
        .iter()
        .zip(pool.states.iter())
        .filter_map(move |(worker, state)| {
            let state = state.as_ref().filter(|s| s.is_fresh(now, stale))?;
            let out: Vec<u32> = health.admitted(worker.address, now, false)?.collect();
            Some((state, out))
        })
        .flat_map(move |(state, out)| {
            (0..state.ranks())
                .filter(move |r| state.effective_tokens(*r).is_some() && !out.contains(&(*r as u32)))
                .map(move |r| room(settings, None).queue(state, r))
        })
}

/// The limits a request of `class` (None: the default class) is judged by.
fn limits(settings: &Settings, class: Option<usize>) -> Limits {
    let class = class.unwrap_or(settings.default_class);
    Limits {
        max_wait_ms: settings.max_wait_ms_of(class),
        max_kv_usage: settings.max_kv_usage,
        max_requests: settings.max_requests_of(class),
    }
}

/// The rule a request of `class` (None: the default class) is judged by.
pub(crate) fn room(settings: &Settings, class: Option<usize>) -> Room {
    Room {
        limits: limits(settings, class),
        prior_tokens_per_s: settings.prefill_tokens_per_s,
        learn: settings.learn_drain_rate,
    }
}

/// The judgement of the pool admission looks at, for a request of
/// `class` (None: the default class); Room without admission.
pub(crate) fn judge(snapshot: &Snapshot, class: Option<usize>) -> Judgement {
    match &snapshot.config.admission {
        Some(settings) => wait::judge(candidate_queues(snapshot, settings), &limits(settings, class)),
        None => Judgement::Room,
    }
}

/// Stage `admission`, for a request of `class` (None: the default
/// class). Without fresh data there is nothing to judge: the
/// request is admitted (counted), and `fail_mode` decides what becomes of
/// it, as without admission.
pub(crate) fn admit(host: &dyn Host, snapshot: &Snapshot, class: Option<usize>) -> Admission {
    let Some(settings) = &snapshot.config.admission else {
        return Admission::Admit(None);
    };
    match judge(snapshot, class) {
        Judgement::Room => Admission::Admit(Some(room(settings, class))),
        Judgement::NoData => {
            host.count(metrics::ADMISSION_NO_DATA, 1);
            Admission::Admit(None)
        }
        Judgement::Saturated {
            ranks,
            retry_after_ms,
        } => Admission::Overloaded(Overload {
            retry_after_ms,
            saturated_ranks: ranks,
        }),
    }
}

/// How many candidate ranks are saturated now (the gauge).
pub(crate) fn saturated_ranks(snapshot: &Snapshot) -> u64 {
    let Some(settings) = &snapshot.config.admission else {
        return 0;
    };
    let limits = limits(settings, None);
    candidate_queues(snapshot, settings)
        .filter(|q| wait::excess_ms(q, &limits).is_some())
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::snapshot::refresh;
    use crate::shared_data::cache::StateCache;
    use crate::shared_data::testing::{fleet, pd_fleet};

    #[test]
    fn without_the_block_every_request_is_admitted_without_a_host_call() {
        let (c, h) = fleet("");
        let mut cache = StateCache::default();
        let snapshot = refresh(&c, &h, &mut cache, 0);
        let calls = h.total_host_calls();
        assert_eq!(admit(&h, &snapshot, None), Admission::Admit(None));
        assert_eq!(h.total_host_calls(), calls);
    }

    #[test]
    fn a_pool_is_overloaded_when_every_fresh_rank_waits_too_long() {
        // 8 ranks; each with about 100 tokens of own queue at 1 token/s.
        let (c, h) = fleet(r#","admission":{"max_wait_ms":50000,"prefill_tokens_per_s":1}"#);
        let mut cache = StateCache::default();
        let snapshot = refresh(&c, &h, &mut cache, 0);
        assert!(
            matches!(admit(&h, &snapshot, None), Admission::Admit(Some(_))),
            "empty queues"
        );
        assert_eq!(saturated_ranks(&snapshot), 0);
        crate::shared_data::testing::queue_prefill(&c, &h, 100_000);
        let snapshot = refresh(&c, &h, &mut cache, 0);
        let Admission::Overloaded(o) = admit(&h, &snapshot, None) else {
            panic!("overloaded")
        };
        assert_eq!(o.saturated_ranks, 8);
        assert_eq!(o.retry_after_ms, 100_000 * 1000 - 50_000);
        assert!(
            matches!(admit(&h, &snapshot, Some(0)), Admission::Overloaded(_)),
            "critical waits twice as long: still too long"
        );
        assert_eq!(saturated_ranks(&snapshot), 8);
        // Stale data: nothing to judge, admitted and counted.
        h.now.set(10_000 + c.stale_after_ms + 1);
        let snapshot = refresh(&c, &h, &mut cache, 0);
        assert_eq!(admit(&h, &snapshot, None), Admission::Admit(None));
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
        running(12);
        let snapshot = refresh(&c, &h, &mut cache, 0);
        assert!(matches!(admit(&h, &snapshot, None), Admission::Overloaded(_)));
        assert!(matches!(admit(&h, &snapshot, Some(1)), Admission::Overloaded(_)));
        assert!(
            matches!(admit(&h, &snapshot, Some(0)), Admission::Admit(Some(_))),
            "critical may fill the rank"
        );
        running(16);
        let snapshot = refresh(&c, &h, &mut cache, 0);
        assert!(matches!(admit(&h, &snapshot, Some(0)), Admission::Overloaded(_)));
        running(7);
        let snapshot = refresh(&c, &h, &mut cache, 0);
        assert!(matches!(admit(&h, &snapshot, Some(2)), Admission::Admit(Some(_))));
        running(8);
        let snapshot = refresh(&c, &h, &mut cache, 0);
        assert!(matches!(admit(&h, &snapshot, Some(2)), Admission::Overloaded(_)));
    }

    #[test]
    fn pd_mode_judges_the_prefill_pool() {
        let (c, h) = pd_fleet(r#","admission":{"max_wait_ms":1000,"prefill_tokens_per_s":1}"#);
        let mut cache = StateCache::default();
        let snapshot = refresh(&c, &h, &mut cache, 0);
        assert_eq!(judged_side(&snapshot), Side::Prefill);
        assert_eq!(
            candidate_queues(&snapshot, c.admission.as_ref().unwrap()).count(),
            4
        );
    }
}
