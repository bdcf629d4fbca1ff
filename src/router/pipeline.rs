//! The routing pipeline every path runs, in one place ([`run`]):
//!
//! ```text
//! refresh -> admission -> pool -> choose -> retry targets -> account -> record -> reply
//! ```
//!
//! `refresh` and `pool` are in `snapshot.rs`, `admission` asks the admission
//! controller, the stages that choose and write are here. A path (body,
//! header or PD mode) says only what differs, as a [`Path`]. Choosing
//! writes nothing; `commit` writes.

use super::outcome::PassReason;
use super::snapshot::{self, Moment, Side, Snapshot};
use super::{Chosen, Decision};
use crate::admission::{Controller, Overloaded};
use crate::config::Config;
use crate::health::NO_HEALTH;
use crate::host::Host;
use crate::metrics;
use crate::prefix::RequestPrefix;
use crate::scheduler::{self, Candidate, Constraint, Context, Pool};
use crate::shared_data::{self, cache::StateCache};
use crate::worker_state::{Charge, PrefillTicket, Ticket};
use std::rc::Rc;

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

/// A request's legs, chosen and committed in this order: the first scores
/// the prompt (prefix affinity) and has it queued on its rank; PD mode has
/// a second (the decode leg).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Legs<'r> {
    pub first: Leg<'r>,
    pub second: Option<Leg<'r>>,
}

/// What a path does with a first leg nobody was chosen for (returned once,
/// never kept: its size does not matter).
#[allow(clippy::large_enum_variant)]
pub(crate) enum Unchosen {
    /// It goes to this worker anyway, unaccounted (PD's prefill workers
    /// take turns).
    GoesTo(usize),
    /// The request ends here: passed through, or refused.
    Decided(Decision),
}

/// A path through the pipeline: everything body, header and PD mode do
/// differently, each hook at its stage.
pub(crate) trait Path<'c> {
    /// Stage `pool`: the legs, and the pools they choose from.
    fn legs<'p>(&self, config: &Config, pin: Option<&'p str>) -> Legs<'p>;

    /// Prefix affinity's view of the prompt, at the clock `refresh` read
    /// (None: off, or no prompt to read).
    fn prefix(&self, config: &'c Config, now_ms: u64) -> Option<RequestPrefix<'c>>;

    /// After `choose`, whatever was found (PD counts a leg without fresh
    /// data).
    fn found(&self, _host: &dyn Host, _first: Option<&Choice>, _second: Option<&Choice>) {}

    /// Nobody was chosen for the first leg: what becomes of it.
    fn unchosen(&self, host: &dyn Host, snapshot: &Snapshot) -> Unchosen;

    /// The tokens the request adds to each leg's rank until a poll counts
    /// them.
    fn cost(&self, config: &Config, prefix: Option<&RequestPrefix>) -> u64;

    /// Without prefix affinity, the prompt the first leg queues on its rank
    /// (admission's queue), if any.
    fn prefill_charge(&self, config: &Config, prefix: Option<&RequestPrefix>) -> Option<PrefillCharge>;

    /// Stage `reply`: the decision, from the committed legs.
    fn reply(self, host: &dyn Host, first: Committed, second: Option<Committed>, moment: Moment) -> Decision;
}

/// Runs `path` through every stage, in order. Err: admission keeps the
/// request out (nothing was chosen or written).
pub(crate) fn run<'c>(
    config: &'c Rc<Config>,
    host: &dyn Host,
    cache: &mut StateCache,
    args: &RouteArgs,
    path: impl Path<'c>,
) -> Result<Decision, Overloaded> {
    let mut snapshot = snapshot::refresh(config, host, cache, args.tie_breaker);
    admit(host, &mut snapshot, args.class)?;
    let mut prefix = path.prefix(config, snapshot.now_ms);
    let legs = path.legs(config, args.pin);
    let first = choose(host, &snapshot, &legs.first, prefix.as_mut());
    let second = legs.second.and_then(|leg| choose(host, &snapshot, &leg, None));
    path.found(host, first.as_ref(), second.as_ref());
    let first = match first {
        Some(choice) => First::Chosen(choice),
        None => match path.unchosen(host, &snapshot) {
            Unchosen::GoesTo(worker) => First::Unaccounted(worker),
            Unchosen::Decided(decision) => return Ok(decision),
        },
    };
    let moment = snapshot.moment();
    let cost = path.cost(config, prefix.as_ref());
    let charge = path.prefill_charge(config, prefix.as_ref());
    let commit_second =
        |cache: &mut StateCache| second.map(|choice| commit(config, host, cache, &choice, cost, None, None));
    let (first, second) = match first {
        First::Chosen(choice) => {
            let first = commit(config, host, cache, &choice, cost, prefix.as_mut(), charge);
            (first, commit_second(cache))
        }
        First::Unaccounted(worker) => {
            let second = commit_second(cache);
            (Committed::unaccounted(cache, worker), second)
        }
    };
    Ok(path.reply(host, first, second, moment))
}

/// The first leg after `choose`.
enum First {
    Chosen(Choice),
    /// Nobody was chosen; it goes to this worker anyway.
    Unaccounted(usize),
}

/// Stage `admission`: the admission controller judges the pool admission
/// looks at (PD's prefill pool, else the forwarded one) for the request's
/// `class`; a request let in chooses there by the rule it was judged by.
fn admit(host: &dyn Host, snapshot: &mut Snapshot, class: Option<usize>) -> Result<(), Overloaded> {
    if snapshot.config.admission.is_none() {
        return Ok(());
    }
    let admission = Controller::new(snapshot.config.admission.as_ref());
    let side = snapshot.judged_side();
    let candidates = snapshot.candidate_queues(side, admission.rule(None));
    let rule = admission.judge(host, class, candidates)?;
    snapshot.rule = rule.map(|r| (side, r));
    Ok(())
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
    // Admission let the request in: ranks with room by its rule first, as
    // long as there are any (a constraint may keep only others).
    let rule = snapshot.rule_for(leg.side);
    let with_room = rule.and_then(|rule| {
        let ctx = Context {
            room: Some(rule),
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

/// A committed leg: where it goes, and what the request gives back at its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Committed {
    pub chosen: Chosen,
    pub alternates: Vec<Chosen>,
    /// The estimate added to the chosen rank; None if accounting could not
    /// be written.
    pub estimate: Option<Ticket>,
    /// The prompt queued on the chosen rank.
    pub queued_prefill: Option<PrefillTicket>,
}

impl Committed {
    /// A leg that goes to `worker` though nobody was chosen (PD's prefill
    /// workers' turn): no rank, nothing accounted.
    pub fn unaccounted(cache: &StateCache, worker: usize) -> Committed {
        Committed {
            chosen: Chosen::new(cache, worker, None),
            alternates: Vec::new(),
            estimate: None,
            queued_prefill: None,
        }
    }
}

/// Stages `retry targets`, `account` and `record` of a chosen leg, which
/// adds `cost` tokens to its rank until a poll counts them; with `prefix`,
/// its uncached prompt is queued on the rank and recorded in the worker's
/// index; without, `charge` is queued if given (admission).
pub(crate) fn commit(
    config: &Config,
    host: &dyn Host,
    cache: &mut StateCache,
    choice: &Choice,
    cost: u64,
    prefix: Option<&mut RequestPrefix>,
    charge: Option<PrefillCharge>,
) -> Committed {
    let candidate = choice.chosen;
    // Before the estimate's write: a write that meets another forgets the
    // cached state, which the rank value is read from.
    let chosen = Chosen::new(cache, candidate.worker, Some(candidate.rank));
    let alternates = retry_targets(host, cache, choice);
    let charge = prefix
        .as_deref()
        .map(|p| PrefillCharge::of(p, candidate.worker - choice.pool_offset, candidate.rank))
        .or(charge);
    let (estimate, queued_prefill) = account(config, host, cache, &candidate, cost, charge);
    if let Some(prefix) = prefix {
        record(config, host, prefix, cache, choice.pool_offset, &candidate);
    }
    // A retry carries the rank value written for the chosen rank: only
    // alternates that read the same value.
    let alternates = alternates
        .into_iter()
        .filter(|a| a.value == chosen.value)
        .collect();
    Committed {
        chosen,
        alternates,
        estimate,
        queued_prefill,
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

/// The prompt a request queues on its chosen rank until its prefill starts
/// (prefix affinity, or admission), and whether its response is streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PrefillCharge {
    charge: Charge,
    streamed: bool,
}

impl PrefillCharge {
    /// Admission without prefix affinity: the request's whole prompt
    /// (`prompt` tokens) queues on its rank.
    pub(crate) fn plain(prompt: u64, streamed: bool) -> PrefillCharge {
        PrefillCharge {
            charge: Charge { prompt, cached: 0 },
            streamed,
        }
    }

    /// Prefix affinity: the prompt less what the index expects the rank
    /// to hold.
    fn of(prefix: &RequestPrefix, pool_worker: usize, rank: u32) -> PrefillCharge {
        PrefillCharge {
            charge: Charge {
                prompt: prefix.prompt.tokens(),
                cached: prefix.cached(pool_worker, rank as usize),
            },
            streamed: prefix.streamed,
        }
    }
}

/// Stage `account`: adds a routed request's estimate (and its queued
/// prefill, in the same write) to its rank and counts the route.
pub(crate) fn account(
    config: &Config,
    host: &dyn Host,
    cache: &mut StateCache,
    chosen: &Candidate,
    cost: u64,
    charge: Option<PrefillCharge>,
) -> (Option<Ticket>, Option<PrefillTicket>) {
    let (worker, rank) = (chosen.worker, chosen.rank);
    let tickets = cache.write(config, host, worker, |state| {
        let estimate = state.add(worker, rank, cost)?;
        let queued = charge
            .as_ref()
            .and_then(|c| state.charge_prefill(worker, rank, c.charge, c.streamed));
        Some((estimate, queued))
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
    chosen: &Candidate,
) {
    if !prefix.records() {
        return;
    }
    let capacity = cache
        .states()
        .get(chosen.worker)
        .and_then(Option::as_ref)
        .and_then(|s| s.prefill.capacity(chosen.rank as usize));
    let first = prefix.take_value(chosen.worker - pool_offset);
    shared_data::update_index(
        config,
        host,
        chosen.worker,
        first,
        prefix.record_on(chosen.rank, capacity),
    );
}

#[cfg(test)]
mod tests;
