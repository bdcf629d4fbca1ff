//! The routing pipeline every path runs: body mode, header mode and both
//! legs of PD mode.
//!
//! ```text
//! refresh -> admission -> pool -> choose -> retry targets -> account -> record -> reply
//! ```
//!
//! `refresh` and `pool` are in `snapshot.rs`, `admission` in `admission.rs`;
//! the stages that choose and write are here, each a function of its own.
//! A path says only what differs: the [`Leg`] (which pool, the constraint,
//! how many alternates), where the cost estimate comes from, whether prefix
//! affinity applies, and what reply it builds (`by_body.rs`, `by_header.rs`,
//! `pd.rs`). Choosing writes nothing; `commit` writes.

use super::admission::{self, Admission, Overload};
use super::outcome::PassReason;
use super::snapshot::{self, Side, Snapshot};
use super::{Chosen, Decision};
use crate::config::Config;
use crate::health::NO_HEALTH;
use crate::host::Host;
use crate::metrics;
use crate::prefix::RequestPrefix;
use crate::scheduler::{self, Candidate, Constraint, Context, Pool};
use crate::shared_data::{self, cache::StateCache};
use crate::worker_state::{Charge, PrefillTicket, Ticket};
use std::rc::Rc;

/// A request admission did not let in: every candidate is saturated.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Refused(Overload);

impl From<Refused> for Decision {
    fn from(r: Refused) -> Decision {
        Decision::Overloaded(r.0)
    }
}

/// Stages `refresh` and `admission`: the snapshot every later stage reads,
/// or the overload that keeps the request out (the lifecycle refuses or
/// holds it and counts what it does).
pub(crate) fn start<'a>(
    config: &'a Rc<Config>,
    host: &dyn Host,
    cache: &'a mut StateCache,
    args: &RouteArgs,
) -> Result<Snapshot<'a>, Refused> {
    let mut snapshot = snapshot::refresh(config, host, cache, args.tie_breaker);
    match admission::admit(host, &snapshot, args.class) {
        Admission::Admit(room) => {
            let side = admission::judged_side(&snapshot);
            snapshot.room = room.map(|r| (side, r));
            Ok(snapshot)
        }
        Admission::Overloaded(overload) => Err(Refused(overload)),
    }
}

/// What the lifecycle tells the pipeline about a request besides its body.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteArgs<'a> {
    /// The test-only pin header's value.
    pub pin: Option<&'a str>,
    /// Varies per request so that equal costs spread.
    pub tie_breaker: u64,
    /// Admission: the request's class (None: the default class).
    pub class: Option<usize>,
}

/// What one leg of a request asks of the pipeline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Leg<'r> {
    pub side: Side,
    pub constraint: Constraint<'r>,
    /// Retry alternates to list after the chosen worker (0: none).
    pub alternates: usize,
}

/// A leg's choice, before anything is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Choice {
    /// `worker` indexes `Config::all_workers`.
    pub chosen: Candidate,
    /// Retry alternates found (by load, with the chosen rank), cheapest first.
    pub found: Vec<Candidate>,
    /// How many the leg asked for.
    pub wanted: usize,
    /// The pool's first worker in `Config::all_workers`.
    pub pool_offset: usize,
}

/// A committed leg: where it goes, and what the request gives back at its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Committed {
    pub to: Chosen,
    pub alternates: Vec<Chosen>,
    /// None if accounting could not be written.
    pub ticket: Option<Ticket>,
    /// Prefix affinity: the prefill charged to the rank.
    pub prefill: Option<PrefillTicket>,
}

/// Stage `choose`: the best (worker, rank) of the leg's pool under its
/// constraint, and its retry alternates. Nothing in rotation (and the
/// request not already a probe): a worker or rank past its cooldown, like
/// Envoy's panic threshold, rather than the fallback policy's pick. A pin
/// that names no candidate is dropped (and counted): it is a preference.
/// With `prefix`, prefix affinity scores the candidates.
pub(crate) fn choose(
    host: &dyn Host,
    snapshot: &Snapshot,
    leg: &Leg,
    mut prefix: Option<&mut RequestPrefix>,
) -> Option<Choice> {
    let pool = snapshot.pool(leg.side);
    let mut pick = choose_in_rotation(host, snapshot, &pool, leg, leg.constraint, prefix.as_deref_mut());
    if pick.is_none() && leg.constraint.pin.is_some() {
        host.count(metrics::PIN_IGNORED, 1);
        let unpinned = Constraint {
            pin: None,
            ..leg.constraint
        };
        pick = choose_in_rotation(host, snapshot, &pool, leg, unpinned, prefix);
    }
    let (chosen, found) = pick?;
    Some(Choice {
        chosen,
        found,
        wanted: leg.alternates,
        pool_offset: pool.offset,
    })
}

/// `choose` under one constraint: in rotation, else probing.
fn choose_in_rotation(
    host: &dyn Host,
    snapshot: &Snapshot,
    pool: &Pool,
    leg: &Leg,
    constraint: Constraint,
    mut prefix: Option<&mut RequestPrefix>,
) -> Option<(Candidate, Vec<Candidate>)> {
    let plain = snapshot.context(constraint);
    let config = snapshot.config;
    // Admission let the request in: ranks with room first, as long as
    // there are any (a constraint may keep only others).
    let room = snapshot.room_for(leg.side);
    let with_room = room.and_then(|room| {
        let ctx = Context {
            room: Some(room),
            ..plain
        };
        run_scheduler(config, host, pool, ctx, prefix.as_deref_mut(), leg.alternates)
    });
    if with_room.is_some() {
        return with_room;
    }
    let ctx = plain;
    run_scheduler(config, host, pool, ctx, prefix.as_deref_mut(), leg.alternates).or_else(|| {
        let probing = !ctx.admit_probing && ctx.health.any_probing(ctx.now_ms);
        probing
            .then(|| {
                let panic = Context {
                    admit_probing: true,
                    ..ctx
                };
                run_scheduler(config, host, pool, panic, prefix, leg.alternates)
            })
            .flatten()
    })
}

/// One scheduler run under `ctx`. With prefix affinity, the indexes of the
/// workers it will score (those its filters keep) are read into `prefix`
/// first, each once per request: the scorers score what was read.
fn run_scheduler(
    config: &Config,
    host: &dyn Host,
    pool: &Pool,
    ctx: Context,
    prefix: Option<&mut RequestPrefix>,
    alternates: usize,
) -> Option<(Candidate, Vec<Candidate>)> {
    let Some(prefix) = prefix else {
        return scheduler::choose_with_alternates(pool, &ctx, alternates);
    };
    scheduler::scored_workers(pool, &ctx, |worker| {
        if prefix.wants(worker) {
            prefix.insert(
                worker,
                shared_data::read_prefix_index(config, host, pool.offset + worker),
            );
        }
    });
    let ctx = Context {
        prefix: Some(prefix),
        ..ctx
    };
    scheduler::choose_with_alternates(pool, &ctx, alternates)
}

/// Why a pool with no candidate at all has none: every worker with fresh
/// data is out of rotation, or there is no fresh data.
pub(crate) fn no_candidate_reason(snapshot: &Snapshot, side: Side) -> PassReason {
    if snapshot.health().is_empty() {
        return PassReason::NoFreshData;
    }
    let blind = Context {
        health: &NO_HEALTH,
        tie_breaker: 0,
        ..snapshot.context(Constraint::default())
    };
    match scheduler::choose(&snapshot.pool(side), &blind) {
        Some(_) => PassReason::NoneInRotation,
        None => PassReason::NoFreshData,
    }
}

/// Stages `retry targets`, `account` and `record` of a chosen leg, which
/// adds `cost` tokens to its rank until a poll counts them; with `prefix`,
/// its prefill is charged and its prompt recorded in the worker's index;
/// without, `queued` is charged if given (admission's queue).
pub(crate) fn commit(
    config: &Config,
    host: &dyn Host,
    cache: &mut StateCache,
    choice: &Choice,
    cost: u64,
    prefix: Option<&mut RequestPrefix>,
    queued: Option<Prefill>,
) -> Committed {
    let at = choice.chosen;
    // Before the estimate's write: a write that meets another forgets the
    // cached state, which the rank value is read from.
    let to = Chosen::new(cache, at.worker, Some(at.rank));
    let alternates = retry_targets(host, cache, choice);
    let prefill = prefix
        .as_deref()
        .map(|p| Prefill::of(p, at.worker - choice.pool_offset, at.rank))
        .or(queued);
    let (ticket, prefill) = account(config, host, cache, &at, cost, prefill);
    if let Some(prefix) = prefix {
        record(config, host, prefix, cache, choice.pool_offset, &at);
    }
    // A retry carries the rank value written for `to`: only alternates
    // that read the same value.
    let alternates = alternates.into_iter().filter(|a| a.value == to.value).collect();
    Committed {
        to,
        alternates,
        ticket,
        prefill,
    }
}

/// Stage `retry targets`: the alternates `choose` found, as route targets;
/// counted when there is none though the leg asks for some.
pub(crate) fn retry_targets(host: &dyn Host, cache: &StateCache, choice: &Choice) -> Vec<Chosen> {
    if choice.wanted == 0 {
        return Vec::new();
    }
    if choice.found.is_empty() {
        host.count(metrics::NO_ALTERNATE, 1);
    }
    choice
        .found
        .iter()
        .map(|c| Chosen::new(cache, c.worker, Some(c.rank)))
        .collect()
}

/// What prefix affinity charges the chosen (worker, rank) for a request, and
/// whether its response is streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Prefill {
    charge: Charge,
    streamed: bool,
}

impl Prefill {
    /// Admission without prefix affinity: the request's whole prompt
    /// (`prompt` tokens) queues on its rank.
    pub(crate) fn plain(prompt: u64, streamed: bool) -> Prefill {
        Prefill {
            charge: Charge { prompt, cached: 0 },
            streamed,
        }
    }

    fn of(prefix: &RequestPrefix, pool_worker: usize, rank: u32) -> Prefill {
        Prefill {
            charge: Charge {
                prompt: prefix.prompt.tokens(),
                cached: prefix.cached(pool_worker, rank as usize),
            },
            streamed: prefix.streamed,
        }
    }
}

/// Stage `account`: adds a routed request's estimate (and, under prefix
/// affinity, its prefill, in the same write) to its rank and counts the route.
pub(crate) fn account(
    config: &Config,
    host: &dyn Host,
    cache: &mut StateCache,
    at: &Candidate,
    cost: u64,
    prefill: Option<Prefill>,
) -> (Option<Ticket>, Option<PrefillTicket>) {
    let (worker, rank) = (at.worker, at.rank);
    let tickets = cache.write(config, host, worker, |state| {
        let ticket = state.add(worker, rank, cost)?;
        let prefill = prefill
            .as_ref()
            .and_then(|p| state.charge_prefill(worker, rank, p.charge, p.streamed));
        Some((ticket, prefill))
    });
    if tickets.is_none() {
        host.count(metrics::ACCOUNTING_SKIPPED, 1);
    }
    host.count(cache.routed_name(worker, rank), 1);
    tickets.map_or((None, None), |(t, p)| (Some(t), p))
}

/// Stage `record`: the routed prompt goes into the chosen worker's prefix
/// index, under the cas of the value this request read (read again only if
/// another thread wrote in between).
pub(crate) fn record(
    config: &Config,
    host: &dyn Host,
    prefix: &mut RequestPrefix,
    cache: &StateCache,
    pool_offset: usize,
    at: &Candidate,
) {
    if !prefix.records() {
        return;
    }
    let capacity = cache
        .states()
        .get(at.worker)
        .and_then(Option::as_ref)
        .and_then(|s| s.prefill.capacity(at.rank as usize));
    let first = prefix.take_value(at.worker - pool_offset);
    shared_data::update_index(
        config,
        host,
        at.worker,
        first,
        prefix.record_on(at.rank, capacity),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::{Outcome, Target};
    use crate::host::fake::FakeHost;
    use crate::shared_data::testing::fleet;

    fn leg(pin: Option<&str>, alternates: usize) -> Leg<'_> {
        Leg {
            side: Side::Routed,
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
    fn an_overloaded_pool_chooses_nothing_and_writes_nothing() {
        let (c, h) = fleet(r#","admission":{"max_wait_ms":100,"prefill_tokens_per_s":1}"#);
        let mut cache = StateCache::default();
        assert!(
            start(&c, &h, &mut cache, &RouteArgs::default()).is_ok(),
            "empty queues"
        );
        crate::shared_data::testing::queue_prefill(&c, &h, 1000);
        let writes = h.host_calls("shared_set");
        let Err(refused) = start(&c, &h, &mut cache, &RouteArgs::default()) else {
            panic!("overloaded")
        };
        let Decision::Overloaded(overload) = refused.into() else {
            panic!("the lifecycle decides")
        };
        assert_eq!(overload.saturated_ranks, 8);
        assert_eq!(h.host_calls("shared_set"), writes);
        assert!(h.counters.borrow().keys().all(|k| !k.contains("rejected")));
    }

    #[test]
    fn choose_drops_a_pin_naming_nobody_and_counts_it() {
        let (c, h) = fleet(r#","prefix_affinity":false"#);
        let mut cache = StateCache::default();
        let snapshot = snapshot::refresh(&c, &h, &mut cache, 0);
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
        let snapshot = snapshot::refresh(&c, &h, &mut cache, 0);
        assert_eq!(
            choose(&h, &snapshot, &leg(None, 0), None),
            None,
            "both cooling down"
        );
        assert_eq!(
            no_candidate_reason(&snapshot, Side::Routed),
            PassReason::NoneInRotation
        );
        h.now.set(10_200);
        let snapshot = snapshot::refresh(&c, &h, &mut cache, 0);
        assert!(!snapshot.admit_probing, "not a probe by draw");
        let probe = choose(&h, &snapshot, &leg(None, 0), None).unwrap();
        assert_eq!((probe.chosen.worker, probe.chosen.rank), (1, 2));
    }

    #[test]
    fn no_candidate_reason_tells_stale_data_from_ejections() {
        let (c, h) = fleet("");
        h.now.set(10_000 + c.stale_after_ms + 1);
        let mut cache = StateCache::default();
        let snapshot = snapshot::refresh(&c, &h, &mut cache, 0);
        assert_eq!(
            no_candidate_reason(&snapshot, Side::Routed),
            PassReason::NoFreshData
        );
    }

    #[test]
    fn commit_lists_the_alternates_writes_the_estimate_and_counts_the_route() {
        let (c, h) = fleet(r#","prefix_affinity":false"#);
        let mut cache = StateCache::default();
        let snapshot = snapshot::refresh(&c, &h, &mut cache, 0);
        let choice = choose(&h, &snapshot, &leg(None, 2), None).unwrap();
        let committed = commit(&c, &h, &mut cache, &choice, 30, None, None);
        assert_eq!(
            (
                committed.to.worker,
                committed.to.rank,
                committed.to.endpoint.as_ref()
            ),
            (1, Some(2), "127.0.0.1:2")
        );
        assert_eq!(committed.alternates.len(), 1);
        assert_eq!(committed.alternates[0].endpoint.as_ref(), "127.0.0.1:1");
        assert_eq!(committed.ticket.map(|t| t.cost), Some(30));
        assert!(committed.prefill.is_none());
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
        let snapshot = snapshot::refresh(&c, &h, &mut cache, 0);
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
}
